"""What both scheduler clients share before a request leaves: where the scheduler is, the
auth header, the owner each lease acquired here has, and one `_Call` per API operation
(method, path, body, headers, timeout and the model its answer decodes into). Fields are
checked here against the service's own models, so a bad one fails before it is sent, with
the same `InvalidRequest` the service would answer."""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter, ValidationError

from openalice_scheduler.errors import InvalidRequest, LeaseNotFound, SchedulerError
from openalice_scheduler.models import (
    AcquireResponse,
    GpuClass,
    GroupBy,
    Health,
    Lease,
    LeaseRequest,
    LeaseState,
    ProviderView,
    Token,
    UsageReport,
    WorkerKind,
)

DEFAULT_URL = "http://localhost:8080"
DEFAULT_TIMEOUT_S = 30.0
# An acquire waits `wait_seconds` in line and then for the provision, which the service
# bounds by PROVISION_TIMEOUT_SECONDS (default 600 s): the read timeout covers both.
ACQUIRE_TIMEOUT_S = 660.0
# A kept-alive connection is given up after 2 s idle: the service closes one after 5 s
# (server.py, KEEP_ALIVE_S), and a request sent on a connection the service is closing at
# that moment fails without an answer ("Server disconnected"), an acquire included, which
# is sent once. httpx's own default (5 s) is the service's, the race at every 5 s pause.
KEEPALIVE_EXPIRY_S = 2.0
LIMITS = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)

T = TypeVar("T")
States = LeaseState | str | Iterable[LeaseState | str]


class SchedulerUnreachable(SchedulerError):
    """No HTTP answer at all: connection refused, DNS failure, timeout. Counted as 503
    (service unavailable): try again later. An acquire that timed out is given back by
    the scheduler when it sees the caller leave."""

    code = "scheduler_unreachable"
    status = 503


@dataclass
class _Call(Generic[T]):
    method: str
    path: str
    adapter: TypeAdapter[T] | None
    lease_id: str = ""
    params: httpx.QueryParams | None = None
    json: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: httpx.Timeout | None = None


_ACQUIRED = TypeAdapter(AcquireResponse)
_LEASE = TypeAdapter(Lease)
_LEASES = TypeAdapter(builtins.list[Lease])
_PROVIDERS = TypeAdapter(builtins.list[ProviderView])
_HEALTH = TypeAdapter(Health)
_USAGE = TypeAdapter(UsageReport)
_TOKEN = TypeAdapter(Token)


class _Core:
    """What both clients share: where to go, the auth header, and which owner each lease
    acquired here has (sent back as X-Lease-Owner)."""

    def __init__(self, url: str | None, secret: str | None, timeout: float) -> None:
        self.url = (url or os.environ.get("SCHEDULER_URL") or DEFAULT_URL).rstrip("/")
        try:
            parsed = httpx.URL(self.url)
        except httpx.InvalidURL as exc:
            raise ValueError(f"invalid scheduler URL {self.url!r}: {exc}") from None
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"invalid scheduler URL {self.url!r}: use http(s)://host[:port]")
        secret = secret if secret is not None else os.environ.get("INTERNAL_SECRET")
        if not secret:
            raise ValueError("no scheduler secret: pass secret= or set INTERNAL_SECRET")
        self.auth = {"X-Internal-Secret": secret}
        self.timeout = timeout
        self.owners: dict[str, str] = {}

    def acquire_call(self, request: LeaseRequest) -> _Call[AcquireResponse]:
        read = request.wait_seconds + ACQUIRE_TIMEOUT_S
        return _Call(
            "POST",
            "/v1/lease",
            _ACQUIRED,
            json=request.model_dump(mode="json", exclude_none=True),
            timeout=httpx.Timeout(self.timeout, read=read),
        )

    def get_call(self, lease: str | Lease) -> _Call[Lease]:
        lease_id = _lease_id(lease)
        return _Call("GET", _lease_path(lease_id), _LEASE, lease_id)

    def list_call(
        self,
        state: States | None,
        owner_id: str | None,
        kind: WorkerKind | str | None,
        provider: str | None,
        limit: int | None,
    ) -> _Call[builtins.list[Lease]]:
        states = [state] if isinstance(state, str) else builtins.list(state or ())
        params: builtins.list[tuple[str, str | int | float | bool | None]] = [
            ("state", str(s)) for s in states
        ]
        if owner_id is not None:
            _check_token("owner_id", owner_id)
        for name, value in (
            ("owner_id", owner_id),
            ("kind", kind),
            ("provider", provider),
            ("limit", limit),
        ):
            if value is not None:
                params.append((name, str(value)))
        return _Call("GET", "/v1/leases", _LEASES, params=httpx.QueryParams(params))

    def renew_call(
        self, lease: str | Lease, ttl_seconds: int | None, owner: str | None
    ) -> _Call[Lease]:
        lease_id = _lease_id(lease)
        body = None if ttl_seconds is None else {"ttl_seconds": ttl_seconds}
        return _Call(
            "POST",
            f"{_lease_path(lease_id)}/renew",
            _LEASE,
            lease_id,
            json=body,
            headers=self.owner_header(lease_id, owner),
        )

    def events_call(self, lease_id: str, timeout: httpx.Timeout) -> _Call[None]:
        """The lease's event stream (read as it comes, not decoded whole)."""
        return _Call(
            "GET",
            f"{_lease_path(lease_id)}/events",
            None,
            lease_id,
            headers={"Accept": "text/event-stream", **self.owner_header(lease_id, None)},
            timeout=timeout,
        )

    def release_call(self, lease: str | Lease, owner: str | None) -> _Call[None]:
        lease_id = _lease_id(lease)
        # Releasing a Docker worker stops a container: allow it longer than a lookup.
        return _Call(
            "DELETE",
            _lease_path(lease_id),
            None,
            lease_id,
            headers=self.owner_header(lease_id, owner),
            timeout=httpx.Timeout(self.timeout, read=max(self.timeout, 120.0)),
        )

    def providers_call(self) -> _Call[builtins.list[ProviderView]]:
        return _Call("GET", "/v1/providers", _PROVIDERS)

    def usage_call(
        self, group_by: GroupBy, since: str | None, until: str | None
    ) -> _Call[UsageReport]:
        params = {"group_by": group_by, "since": since, "until": until}
        return _Call(
            "GET",
            "/v1/usage",
            _USAGE,
            params=httpx.QueryParams(
                {name: value for name, value in params.items() if value is not None}
            ),
        )

    def health_call(self) -> _Call[Health]:
        return _Call("GET", "/health", _HEALTH)

    def owner_header(self, lease_id: str, owner: str | None) -> dict[str, str]:
        if owner is None:
            owner = self.owners.get(lease_id)  # checked when the lease was acquired
        else:
            # An owner_id is a token (models.Token); anything else can match no lease, and
            # may not even be a header (httpx would raise UnicodeEncodeError on `é`).
            _check_token("owner", owner)
        return {"X-Lease-Owner": owner} if owner is not None else {}

    def remember(self, lease: Lease, request: LeaseRequest) -> None:
        if request.owner_id is not None:
            self.owners[lease.lease_id] = request.owner_id

    def forget(self, lease_id: str) -> None:
        self.owners.pop(lease_id, None)

    @contextlib.contextmanager
    def forgetting_on_404(self, lease_id: str) -> Iterator[None]:
        # A lease that answers 404 has ended for good: its owner need not be kept.
        try:
            yield
        except LeaseNotFound:
            self.forget(lease_id)
            raise

    def unreachable(self, exc: httpx.RequestError) -> SchedulerUnreachable:
        why = str(exc) or type(exc).__name__
        return SchedulerUnreachable(f"cannot reach the scheduler at {self.url}: {why}")


def _lease_request(
    kind: WorkerKind | str,
    gpu: GpuClass | str,
    ttl_seconds: int,
    owner_id: str | None,
    correlation_id: str | None,
    region: str | None,
    env: Mapping[str, str] | None,
    wait_seconds: int,
    priority_class: str | None = None,
) -> LeaseRequest:
    """Checked here against the same model the service uses, so a bad field fails fast
    with the same InvalidRequest the service would answer."""
    try:
        return LeaseRequest.model_validate(
            {
                "kind": kind,
                "gpu": gpu,
                "ttl_seconds": ttl_seconds,
                "owner_id": owner_id,
                "correlation_id": correlation_id,
                "region": region,
                "env": dict(env or {}),
                "wait_seconds": wait_seconds,
                "priority_class": priority_class,
            }
        )
    except ValidationError as exc:
        # `from None`: the ValidationError's text repeats the input, env values included.
        raise _invalid(exc) from None


def _check_token(name: str, value: str) -> None:
    """InvalidRequest naming `name` unless `value` is a Token, the service's own rule."""
    try:
        _TOKEN.validate_python(value)
    except ValidationError as exc:
        raise _invalid(exc, (name,)) from None


def _invalid(exc: ValidationError, at: tuple[str, ...] = ()) -> InvalidRequest:
    details = []
    for error in exc.errors(include_input=False, include_url=False):
        where = ".".join(str(part) for part in (*at, *error["loc"])) or "body"
        details.append({"field": where, "message": str(error["msg"]).removeprefix("Value error, ")})
    first = details[0]
    return InvalidRequest(
        f"{first['field']}: {first['message']}", field=first["field"], errors=details
    )


def _lease_id(lease: str | Lease) -> str:
    return lease.lease_id if isinstance(lease, Lease) else lease


def _lease_path(lease_id: str) -> str:
    if not lease_id:
        # `/v1/lease/` is no lease's path: the service would answer a redirect, not 404.
        raise InvalidRequest(
            "lease_id: must not be empty",
            field="lease_id",
            errors=[{"field": "lease_id", "message": "must not be empty"}],
        )
    return f"/v1/lease/{quote(lease_id, safe='')}"
