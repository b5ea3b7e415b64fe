"""What both RunPod API drivers share: the request and result types (`PodRequest`, `Pod`,
`GpuStock`), `RunPodError` with its `ErrorKind`s, and `RunPodClient`, the base that owns
the transport (Bearer auth, per-call timeouts, 429 and 5xx retries, the key blanked out of
error text), with the decoding helpers both drivers use: HTTP status to error kind, the
words that mean "no capacity", and a JSON object or a server-side failure."""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 30.0
# How RunPod words "no capacity" (REST 400 `detail`, GraphQL message): "There are no longer
# any instances available with the requested specifications. Please refresh and try
# again." and variants ("... with the request specifications. Please try again later.").
# REST answers 400 for a broken rule too; only these words tell the two apart.
_NO_CAPACITY_WORDS = ("no longer any instances available", "no instances available")


class ErrorKind(StrEnum):
    invalid = "invalid"  # 422: our body broke the contract; never retried (a bug)
    rejected = "rejected"  # 400: a rule broken or no capacity; try the next candidate
    unauthorized = "unauthorized"  # 401: bad key; provider unhealthy
    payment = "payment"  # 402: balance too low; no candidate will succeed
    forbidden = "forbidden"  # 403: no access to that pool; skip the candidate
    rate_limited = "rate_limited"  # 429 after our retries
    server = "server"  # 5xx after our retries
    timeout = "timeout"  # no answer in time (the call may have happened)
    unreachable = "unreachable"  # no connection
    not_found = "not_found"


class RunPodError(Exception):
    def __init__(
        self, kind: ErrorKind, detail: str, status: int | None = None, *, no_capacity: bool = False
    ) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.status = status
        # A refusal (`rejected`) for want of capacity, not for a broken rule: it may pass.
        self.no_capacity = no_capacity

    @property
    def uncertain(self) -> bool:
        """The call may have taken effect although it failed (a create may have made a pod)."""
        return self.kind in (ErrorKind.server, ErrorKind.timeout)


@dataclass(frozen=True, slots=True)
class PodRequest:
    name: str
    env: Mapping[str, str]
    ports: Sequence[str]
    image: str | None = None
    template_id: str | None = None
    gpu_type_id: str | None = None  # None: a CPU pod
    cpu_flavor: str = "cpu5c"
    vcpu_count: int = 2
    cloud: str = "SECURE"
    data_center_ids: Sequence[str] = ()
    disk_gb: int = 20


@dataclass(frozen=True, slots=True)
class Pod:
    id: str
    name: str
    status: str  # PROVISIONING, STARTING, RUNNING, EXITED, ERROR, TERMINATED
    env: Mapping[str, str] = field(default_factory=dict)
    # What the pod costs, USD per hour, and its GPU type, when the answer says.
    cost_per_hr: float | None = None
    gpu_type: str | None = None

    @property
    def running(self) -> bool:
        return self.status == "RUNNING"

    @property
    def dead(self) -> bool:
        return self.status in ("EXITED", "ERROR", "TERMINATED")


@dataclass(frozen=True, slots=True)
class GpuStock:
    id: str
    availability: str  # NONE, LOW, MEDIUM, HIGH
    price_secure: float
    price_community: float
    data_centers: Mapping[str, str]  # data center id → availability


class RunPodClient:
    """Common transport: Bearer auth, per-call timeouts, 429 and 5xx handling."""

    api = "base"

    def __init__(
        self,
        api_key: str,
        base_url: str,
        *,
        http: httpx.AsyncClient | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        # A burst of creates reuses its connections on the next burst (TLS at RunPod is
        # dear): keep more alive than httpx's 20, but not all 100: httpcore looks at every
        # pooled connection on each request. `verify`: a TLS context to share (httpx loads
        # the CA bundle again for each client otherwise).
        self._http = http or httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=timeout,
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=32),
            verify=verify,
        )
        self._auth = {"Authorization": f"Bearer {api_key}"}
        self._key = api_key
        self.retries = retries
        self.backoff = backoff

    async def close(self) -> None:
        await self._http.aclose()

    async def create_pod(self, request: PodRequest) -> Pod:
        raise NotImplementedError

    async def get_pod(self, pod_id: str) -> Pod | None:
        raise NotImplementedError

    async def list_pods(self) -> list[Pod]:
        raise NotImplementedError

    async def terminate_pod(self, pod_id: str) -> None:
        """Idempotent: a pod already gone counts as terminated."""
        raise NotImplementedError

    async def gpu_catalog(self) -> list[GpuStock] | None:
        """Stock and price per GPU type, or None where the API has no catalog."""
        return None

    async def _send(
        self, method: str, path: str, *, retry_server_errors: bool, **kwargs: Any
    ) -> httpx.Response:
        """One logical call. 429 waits `Retry-After` and repeats (nothing happened);
        5xx repeats with backoff only when `retry_server_errors` (safe to repeat)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._http.request(method, path, headers=self._auth, **kwargs)
            except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                # No connection was made: nothing was sent, so repeating is always safe.
                if attempt <= self.retries:
                    await self._sleep_backoff(attempt)
                    continue
                raise RunPodError(
                    ErrorKind.unreachable, f"RunPod API unreachable ({type(exc).__name__})"
                ) from exc
            except httpx.TimeoutException as exc:
                if retry_server_errors and attempt <= self.retries:
                    await self._sleep_backoff(attempt)
                    continue
                raise RunPodError(
                    ErrorKind.timeout, f"RunPod did not answer {method} in time"
                ) from exc
            except httpx.TransportError as exc:
                # A refused connection sent nothing; a broken one may have been heard.
                sent_nothing = isinstance(exc, httpx.ConnectError)
                if (sent_nothing or retry_server_errors) and attempt <= self.retries:
                    await self._sleep_backoff(attempt)
                    continue
                kind = ErrorKind.unreachable if sent_nothing else ErrorKind.timeout
                raise RunPodError(kind, f"RunPod API unreachable ({type(exc).__name__})") from exc
            status = response.status_code
            if status == 429 and attempt <= self.retries:
                wait = _retry_after(response.headers.get("Retry-After"), self.backoff * attempt)
                log.info("RunPod rate limited %s %s; waiting %.1f s", method, _path(path), wait)
                await asyncio.sleep(wait)
                continue
            if status >= 500 and retry_server_errors and attempt <= self.retries:
                await self._sleep_backoff(attempt)
                continue
            return response

    async def _sleep_backoff(self, attempt: int) -> None:
        await asyncio.sleep(self.backoff * (2 ** (attempt - 1)) * (0.5 + random.random()))

    def _error(
        self, kind: ErrorKind, detail: str, status: int | None = None, *, no_capacity: bool = False
    ) -> RunPodError:
        """An error whose text came (partly) from RunPod: the key is blanked out of it, in
        case an answer ever echoes the Authorization header back."""
        if len(self._key) >= 4:
            detail = detail.replace(self._key, "[redacted]")
        return RunPodError(kind, detail, status, no_capacity=no_capacity)


# --- decoding shared by both drivers ---------------------------------------------


def _says_no_capacity(detail: str) -> bool:
    lowered = detail.lower()
    return any(words in lowered for words in _NO_CAPACITY_WORDS)


def _json(response: httpx.Response) -> Any:
    """The JSON object of a successful answer; anything else (an HTML page from a proxy on
    the way) is a server-side failure, not a crash of the caller."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise RunPodError(
            ErrorKind.server,
            f"RunPod answered HTTP {response.status_code} without a JSON object",
            response.status_code,
        )
    return body


def _kind_for_status(status: int) -> ErrorKind:
    if status == 400:
        return ErrorKind.rejected
    if status == 401:
        return ErrorKind.unauthorized
    if status == 402:
        return ErrorKind.payment
    if status == 403:
        return ErrorKind.forbidden
    if status == 404:
        return ErrorKind.not_found
    if status == 429:
        return ErrorKind.rate_limited
    if status >= 500:
        return ErrorKind.server
    return ErrorKind.invalid


def _retry_after(value: str | None, default: float) -> float:
    try:
        seconds = float(value) if value is not None else default
    except ValueError:
        seconds = default
    return max(0.0, min(seconds, MAX_RETRY_AFTER_S))


def _path(path: str) -> str:
    return path.split("?", 1)[0]
