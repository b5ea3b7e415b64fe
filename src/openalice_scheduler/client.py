"""Python client for a running scheduler: `SchedulerClient` (sync) and
`AsyncSchedulerClient`, on httpx.

Answers come back as the wire models (`Lease`, `ProviderView`, `Health`); error answers are
raised as the typed exceptions of `errors.py`, chosen by the body's `error` code, so
`except QuotaExceeded` works the same on both sides of the wire. `lease()` holds a worker
for a block: it acquires, renews in the background at a third of the TTL, and releases on
exit, also when the block raises.

    with SchedulerClient() as client:  # SCHEDULER_URL, INTERNAL_SECRET
        with client.lease("renderer", ttl_seconds=300, owner_id="me") as held:
            render(held.endpoint)

The secret travels only in the `X-Internal-Secret` header: it is never logged, printed or
put in an exception. Neither are `env` values."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, cast
from urllib.parse import quote

import httpx
from pydantic import TypeAdapter, ValidationError

from openalice_scheduler import errors
from openalice_scheduler.errors import (
    Forbidden,
    InvalidRequest,
    LeaseNotFound,
    ReleaseFailed,
    SchedulerError,
    Unauthorized,
)
from openalice_scheduler.models import (
    AcquireResponse,
    GpuClass,
    Health,
    Lease,
    LeaseRequest,
    LeaseState,
    ProviderView,
    Token,
    WorkerKind,
)

__all__ = [
    "AsyncSchedulerClient",
    "HeldLease",
    "SchedulerClient",
    "SchedulerUnreachable",
]

log = logging.getLogger(__name__)

DEFAULT_URL = "http://localhost:8080"
DEFAULT_TIMEOUT_S = 30.0
# An acquire waits `wait_seconds` in line and then for the provision, which the service
# bounds by PROVISION_TIMEOUT_SECONDS (default 600 s): the read timeout covers both.
ACQUIRE_TIMEOUT_S = 660.0
# After a failed renewal, try again sooner than the regular third of the TTL.
RENEW_RETRY_MAX_S = 30.0

T = TypeVar("T")
States = LeaseState | str | Iterable[LeaseState | str]


class SchedulerUnreachable(SchedulerError):
    """No HTTP answer at all: connection refused, DNS failure, timeout. Counted as 503
    (service unavailable): try again later. An acquire that timed out is given back by
    the scheduler when it sees the caller leave."""

    code = "scheduler_unreachable"
    status = 503


class HeldLease:
    """A lease held by `lease()`, kept fresh by its renewals. `lost` turns true when the
    scheduler ended the lease (a renewal answered 404): the worker is gone, stop using it."""

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.renewals = 0
        self.lost = False
        self.error: SchedulerError | None = None  # last renewal failure; None after a success

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    @property
    def endpoint(self) -> str:
        return self.lease.endpoint

    @property
    def expires_at(self) -> str:
        return self.lease.expires_at

    def __repr__(self) -> str:
        return (f"HeldLease(lease_id={self.lease_id!r}, endpoint={self.endpoint!r}, "
                f"expires_at={self.expires_at!r}, renewals={self.renewals}, lost={self.lost})")


class SchedulerClient:
    """Blocking client. `url` and `secret` default to `SCHEDULER_URL` (else
    http://localhost:8080) and `INTERNAL_SECRET`. Leases acquired with an `owner_id` are
    renewed and released with a matching `X-Lease-Owner` without being told again."""

    def __init__(
        self,
        url: str | None = None,
        secret: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._core = _Core(url, secret, timeout)
        self._http = httpx.Client(
            base_url=self._core.url, headers=self._core.auth, timeout=timeout,
            transport=transport,
        )

    @property
    def url(self) -> str:
        return self._core.url

    def acquire(
        self,
        kind: WorkerKind | str,
        *,
        gpu: GpuClass | str = GpuClass.none,
        ttl_seconds: int = 3600,
        owner_id: str | None = None,
        correlation_id: str | None = None,
        region: str | None = None,
        env: Mapping[str, str] | None = None,
        wait_seconds: int = 0,
    ) -> Lease:
        """A worker for `ttl_seconds`. With `wait_seconds`, waits in line that long for
        capacity before NoProviderAvailable. Raises InvalidRequest before sending when a
        field breaks the contract's rules."""
        request = _lease_request(kind, gpu, ttl_seconds, owner_id, correlation_id, region,
                                 env, wait_seconds)
        lease = self._send(self._core.acquire_call(request)).lease
        self._core.remember(lease, request)
        return lease

    def get(self, lease: str | Lease) -> Lease:
        """The lease in any state (released ones too)."""
        return self._send(self._core.get_call(lease))

    def list(
        self,
        *,
        state: States | None = None,
        owner_id: str | None = None,
        kind: WorkerKind | str | None = None,
        provider: str | None = None,
        limit: int | None = None,
    ) -> builtins.list[Lease]:
        """The active leases; with filters, those matching (`state` defaults to active)."""
        return self._send(self._core.list_call(state, owner_id, kind, provider, limit))

    def renew(
        self, lease: str | Lease, *, ttl_seconds: int | None = None, owner: str | None = None
    ) -> Lease:
        """Extend to now + `ttl_seconds` (default: the lease's own TTL). An ended lease
        raises LeaseNotFound: leases are never resurrected."""
        call = self._core.renew_call(lease, ttl_seconds, owner)
        with self._core.forgetting_on_404(call.lease_id):
            return self._send(call)

    def release(self, lease: str | Lease, *, owner: str | None = None) -> None:
        """Give the lease back; the scheduler destroys the worker."""
        call = self._core.release_call(lease, owner)
        with self._core.forgetting_on_404(call.lease_id):
            self._send(call)
        self._core.forget(call.lease_id)

    def providers(self) -> builtins.list[ProviderView]:
        return self._send(self._core.providers_call())

    def health(self) -> Health:
        return self._send(self._core.health_call())

    @contextlib.contextmanager
    def lease(
        self,
        kind: WorkerKind | str,
        *,
        gpu: GpuClass | str = GpuClass.none,
        ttl_seconds: int = 3600,
        owner_id: str | None = None,
        correlation_id: str | None = None,
        region: str | None = None,
        env: Mapping[str, str] | None = None,
        wait_seconds: int = 0,
    ) -> Iterator[HeldLease]:
        """Hold a worker for the block: acquire, renew every third of the TTL from a daemon
        thread, release on exit (also when the block raises; then a failing release is
        logged, not raised, so the block's own exception comes through)."""
        lease = self.acquire(kind, gpu=gpu, ttl_seconds=ttl_seconds, owner_id=owner_id,
                             correlation_id=correlation_id, region=region, env=env,
                             wait_seconds=wait_seconds)
        held = HeldLease(lease)
        stop = threading.Event()
        renewer = threading.Thread(
            target=self._keep_renewed, args=(held, ttl_seconds, stop),
            name=f"renew-lease-{lease.lease_id[:8]}", daemon=True,
        )
        renewer.start()
        try:
            yield held
        except BaseException:
            stop.set()
            renewer.join(self._core.timeout + 1)
            with _logged(held, "release"):
                self._release_held(held)
            raise
        stop.set()
        renewer.join(self._core.timeout + 1)
        self._release_held(held)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SchedulerClient(url={self.url!r})"

    def _send(self, call: _Call[T]) -> T:
        try:
            response = self._http.request(
                call.method, call.path, params=call.params, json=call.json,
                headers=call.headers, timeout=call.timeout or httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.RequestError as exc:
            raise self._core.unreachable(exc) from None
        return _decode(response, call)

    def _keep_renewed(self, held: HeldLease, ttl: int, stop: threading.Event) -> None:
        delay = _renew_every(ttl)
        while not stop.wait(delay):
            try:
                held.lease = self.renew(held.lease_id, ttl_seconds=ttl)
            except SchedulerError as exc:
                if not _renewal_failed(held, exc):
                    return
                delay = _retry_every(ttl)
            else:
                _renewed(held)
                delay = _renew_every(ttl)

    def _release_held(self, held: HeldLease) -> None:
        if held.lost:
            return
        with _release_done():
            self.release(held.lease_id)


class AsyncSchedulerClient:
    """The asyncio twin of `SchedulerClient`: the same methods, awaited; `lease()` is an
    async context manager that renews from a task."""

    def __init__(
        self,
        url: str | None = None,
        secret: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._core = _Core(url, secret, timeout)
        self._http = httpx.AsyncClient(
            base_url=self._core.url, headers=self._core.auth, timeout=timeout,
            transport=transport,
        )

    @property
    def url(self) -> str:
        return self._core.url

    async def acquire(
        self,
        kind: WorkerKind | str,
        *,
        gpu: GpuClass | str = GpuClass.none,
        ttl_seconds: int = 3600,
        owner_id: str | None = None,
        correlation_id: str | None = None,
        region: str | None = None,
        env: Mapping[str, str] | None = None,
        wait_seconds: int = 0,
    ) -> Lease:
        """See `SchedulerClient.acquire`."""
        request = _lease_request(kind, gpu, ttl_seconds, owner_id, correlation_id, region,
                                 env, wait_seconds)
        lease = (await self._send(self._core.acquire_call(request))).lease
        self._core.remember(lease, request)
        return lease

    async def get(self, lease: str | Lease) -> Lease:
        return await self._send(self._core.get_call(lease))

    async def list(
        self,
        *,
        state: States | None = None,
        owner_id: str | None = None,
        kind: WorkerKind | str | None = None,
        provider: str | None = None,
        limit: int | None = None,
    ) -> builtins.list[Lease]:
        return await self._send(self._core.list_call(state, owner_id, kind, provider, limit))

    async def renew(
        self, lease: str | Lease, *, ttl_seconds: int | None = None, owner: str | None = None
    ) -> Lease:
        call = self._core.renew_call(lease, ttl_seconds, owner)
        with self._core.forgetting_on_404(call.lease_id):
            return await self._send(call)

    async def release(self, lease: str | Lease, *, owner: str | None = None) -> None:
        call = self._core.release_call(lease, owner)
        with self._core.forgetting_on_404(call.lease_id):
            await self._send(call)
        self._core.forget(call.lease_id)

    async def providers(self) -> builtins.list[ProviderView]:
        return await self._send(self._core.providers_call())

    async def health(self) -> Health:
        return await self._send(self._core.health_call())

    @contextlib.asynccontextmanager
    async def lease(
        self,
        kind: WorkerKind | str,
        *,
        gpu: GpuClass | str = GpuClass.none,
        ttl_seconds: int = 3600,
        owner_id: str | None = None,
        correlation_id: str | None = None,
        region: str | None = None,
        env: Mapping[str, str] | None = None,
        wait_seconds: int = 0,
    ) -> AsyncIterator[HeldLease]:
        """See `SchedulerClient.lease`; the renewals run in a task."""
        lease = await self.acquire(kind, gpu=gpu, ttl_seconds=ttl_seconds, owner_id=owner_id,
                                   correlation_id=correlation_id, region=region, env=env,
                                   wait_seconds=wait_seconds)
        held = HeldLease(lease)
        renewer = asyncio.create_task(self._keep_renewed(held, ttl_seconds),
                                      name=f"renew-lease-{lease.lease_id[:8]}")
        try:
            yield held
        except BaseException:
            await _cancel(renewer)
            with _logged(held, "release"):
                await self._release_held(held)
            raise
        await _cancel(renewer)
        await self._release_held(held)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSchedulerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"AsyncSchedulerClient(url={self.url!r})"

    async def _send(self, call: _Call[T]) -> T:
        try:
            response = await self._http.request(
                call.method, call.path, params=call.params, json=call.json,
                headers=call.headers, timeout=call.timeout or httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.RequestError as exc:
            raise self._core.unreachable(exc) from None
        return _decode(response, call)

    async def _keep_renewed(self, held: HeldLease, ttl: int) -> None:
        delay = _renew_every(ttl)
        while True:
            await asyncio.sleep(delay)
            try:
                held.lease = await self.renew(held.lease_id, ttl_seconds=ttl)
            except SchedulerError as exc:
                if not _renewal_failed(held, exc):
                    return
                delay = _retry_every(ttl)
            else:
                _renewed(held)
                delay = _renew_every(ttl)

    async def _release_held(self, held: HeldLease) -> None:
        if held.lost:
            return
        with _release_done():
            await self.release(held.lease_id)


# --- shared by both clients: requests, owners, error decoding ----------------------------


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
        return _Call("POST", "/v1/lease", _ACQUIRED,
                     json=request.model_dump(mode="json", exclude_none=True),
                     timeout=httpx.Timeout(self.timeout, read=read))

    def get_call(self, lease: str | Lease) -> _Call[Lease]:
        lease_id = _lease_id(lease)
        return _Call("GET", _lease_path(lease_id), _LEASE, lease_id)

    def list_call(
        self, state: States | None, owner_id: str | None, kind: WorkerKind | str | None,
        provider: str | None, limit: int | None,
    ) -> _Call[builtins.list[Lease]]:
        states = [state] if isinstance(state, str) else builtins.list(state or ())
        params: builtins.list[tuple[str, str | int | float | bool | None]] = [
            ("state", str(s)) for s in states
        ]
        if owner_id is not None:
            _check_token("owner_id", owner_id)
        for name, value in (("owner_id", owner_id), ("kind", kind), ("provider", provider),
                            ("limit", limit)):
            if value is not None:
                params.append((name, str(value)))
        return _Call("GET", "/v1/leases", _LEASES, params=httpx.QueryParams(params))

    def renew_call(
        self, lease: str | Lease, ttl_seconds: int | None, owner: str | None
    ) -> _Call[Lease]:
        lease_id = _lease_id(lease)
        body = None if ttl_seconds is None else {"ttl_seconds": ttl_seconds}
        return _Call("POST", f"{_lease_path(lease_id)}/renew", _LEASE, lease_id, json=body,
                     headers=self.owner_header(lease_id, owner))

    def release_call(self, lease: str | Lease, owner: str | None) -> _Call[None]:
        lease_id = _lease_id(lease)
        # Releasing a Docker worker stops a container: allow it longer than a lookup.
        return _Call("DELETE", _lease_path(lease_id), None, lease_id,
                     headers=self.owner_header(lease_id, owner),
                     timeout=httpx.Timeout(self.timeout, read=max(self.timeout, 120.0)))

    def providers_call(self) -> _Call[builtins.list[ProviderView]]:
        return _Call("GET", "/v1/providers", _PROVIDERS)

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
    kind: WorkerKind | str, gpu: GpuClass | str, ttl_seconds: int, owner_id: str | None,
    correlation_id: str | None, region: str | None, env: Mapping[str, str] | None,
    wait_seconds: int,
) -> LeaseRequest:
    """Checked here against the same model the service uses, so a bad field fails fast
    with the same InvalidRequest the service would answer."""
    try:
        return LeaseRequest.model_validate({
            "kind": kind, "gpu": gpu, "ttl_seconds": ttl_seconds, "owner_id": owner_id,
            "correlation_id": correlation_id, "region": region, "env": dict(env or {}),
            "wait_seconds": wait_seconds,
        })
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
        details.append({"field": where,
                        "message": str(error["msg"]).removeprefix("Value error, ")})
    first = details[0]
    return InvalidRequest(f"{first['field']}: {first['message']}", field=first["field"],
                          errors=details)


def _decode(response: httpx.Response, call: _Call[T]) -> T:
    if not response.is_success:
        raise _error(response)
    if call.adapter is None:
        return cast(T, None)
    try:
        return call.adapter.validate_json(response.content)
    except ValidationError:
        raise _unknown_error("invalid_response", response.status_code)(
            f"the scheduler answered {call.method} {call.path} with an unexpected body"
        ) from None


def _error(response: httpx.Response) -> SchedulerError:
    """The typed exception for an error answer, by its `error` code."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("error"), str):
        # Not the scheduler's own answer (a proxy, say); its body is not repeated.
        body = {"error": f"http_{response.status_code}",
                "message": f"HTTP {response.status_code} {response.reason_phrase} "
                           f"from {response.request.method} {response.request.url.path}"}
    code = body["error"]
    cls = _KNOWN_ERRORS.get(code) or _unknown_error(code, response.status_code)
    headers = {"Retry-After": response.headers["Retry-After"]} \
        if "Retry-After" in response.headers else None
    exc = cls(str(body.get("message") or code), headers=headers)
    exc.details = {k: v for k, v in body.items() if k not in ("error", "message")}
    return exc


def _known_errors() -> dict[str, type[SchedulerError]]:
    """code → class, for the tree in errors.py (the base class is `internal_error`)."""
    found: dict[str, type[SchedulerError]] = {}
    pending: builtins.list[type[SchedulerError]] = [SchedulerError]
    while pending:
        cls = pending.pop()
        if cls.__module__ == errors.__name__:
            found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


_KNOWN_ERRORS = _known_errors()


@functools.lru_cache(maxsize=64)
def _unknown_error(code: str, status: int) -> type[SchedulerError]:
    """A SchedulerError whose `code` and `status` are those of an answer this client has
    no class for (a newer service, a proxy): still caught by `except SchedulerError`."""
    return cast(type[SchedulerError], type(
        "SchedulerError", (SchedulerError,),
        {"code": code, "status": status, "__module__": __name__},
    ))


def _lease_id(lease: str | Lease) -> str:
    return lease.lease_id if isinstance(lease, Lease) else lease


def _lease_path(lease_id: str) -> str:
    if not lease_id:
        # `/v1/lease/` is no lease's path: the service would answer a redirect, not 404.
        raise InvalidRequest("lease_id: must not be empty", field="lease_id",
                             errors=[{"field": "lease_id", "message": "must not be empty"}])
    return f"/v1/lease/{quote(lease_id, safe='')}"


# --- renewing in the background ---------------------------------------------------------


def _renew_every(ttl: int) -> float:
    return ttl / 3


def _retry_every(ttl: int) -> float:
    return min(ttl / 9, RENEW_RETRY_MAX_S)


def _renewed(held: HeldLease) -> None:
    held.renewals += 1
    held.error = None


def _renewal_failed(held: HeldLease, exc: SchedulerError) -> bool:
    """Record a failed renewal; whether to keep trying (only errors that may pass do)."""
    held.error = exc
    if isinstance(exc, LeaseNotFound):
        held.lost = True
        log.warning("lease %s ended on the scheduler (%s); no longer renewed",
                    held.lease_id, exc.message)
        return False
    if isinstance(exc, Unauthorized | Forbidden | InvalidRequest):
        log.warning("lease %s: renewal refused (%s); no longer renewed", held.lease_id, exc.code)
        return False
    log.warning("lease %s: renewal failed (%s); retrying", held.lease_id, exc.code)
    return True


@contextlib.contextmanager
def _release_done() -> Iterator[None]:
    """Release outcomes that leave nothing to do: already ended (404), or the provider
    failed and the scheduler keeps retrying on its own (502 release_failed)."""
    try:
        yield
    except LeaseNotFound:
        pass
    except ReleaseFailed as exc:
        log.warning("release failed on the provider (%s); the scheduler retries it", exc.message)


@contextlib.contextmanager
def _logged(held: HeldLease, what: str) -> Iterator[None]:
    # While the block's own exception propagates, a failing release must not replace it.
    try:
        yield
    except SchedulerError as exc:
        log.warning("lease %s: %s failed (%s: %s); it ends at its expiry", held.lease_id, what,
                    exc.code, exc.message)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    # wait(), not `await task`: a cancellation of the caller itself must still come through.
    await asyncio.wait([task])
    if not task.cancelled() and task.exception() is not None:
        log.error("lease renewal task crashed", exc_info=task.exception())
