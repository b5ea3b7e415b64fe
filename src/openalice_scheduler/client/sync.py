"""The blocking scheduler client, `SchedulerClient`: one method per API operation on an
`httpx.Client`, and `lease()`, which holds a worker for a block, renews it from a daemon
thread and listens to its events from another. Requests are built by `core.py` and
answers decoded by `decoding.py`, the same as for the asyncio twin in `aio.py`."""

from __future__ import annotations

import builtins
import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import TypeVar

import httpx

from openalice_scheduler.client.core import (
    DEFAULT_TIMEOUT_S,
    LIMITS,
    States,
    _Call,
    _Core,
    _lease_request,
)
from openalice_scheduler.client.decoding import _decode
from openalice_scheduler.client.listening import (
    RECONNECT_FIRST_S,
    EventReader,
    gives_up,
    heard,
    next_backoff,
    stream_timeout,
)
from openalice_scheduler.client.renewal import (
    HeldLease,
    OnLost,
    OnPreempt,
    _keeps_renewing,
    _logged,
    _lost,
    _needs_release,
    _release_done,
    _renew_every,
    _renewal_failed,
    _renewed,
    _retry_every,
)
from openalice_scheduler.client.retrying import RetryPolicy, _AcquireRetries
from openalice_scheduler.errors import SchedulerError
from openalice_scheduler.models import (
    GpuClass,
    GroupBy,
    Health,
    Lease,
    ProviderView,
    UsageReport,
    WorkerKind,
)

T = TypeVar("T")
log = logging.getLogger(__name__)


class SchedulerClient:
    """Blocking client. `url` and `secret` default to `SCHEDULER_URL` (else
    http://localhost:8080) and `INTERNAL_SECRET`. Leases acquired with an `owner_id` are
    renewed and released with a matching `X-Lease-Owner` without being told again. An
    acquire with both `owner_id` and `correlation_id` is retried by `retry` (see
    `retrying.py`) while the scheduler is unreachable or its store unavailable; `None`
    sends every acquire once."""

    def __init__(
        self,
        url: str | None = None,
        secret: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = RetryPolicy(),
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._core = _Core(url, secret, timeout)
        self._retry = retry
        self._http = httpx.Client(
            base_url=self._core.url,
            headers=self._core.auth,
            timeout=timeout,
            limits=LIMITS,
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
        priority_class: str | None = None,
    ) -> Lease:
        """A worker for `ttl_seconds`. With `wait_seconds`, waits in line that long for
        capacity before NoProviderAvailable. Raises InvalidRequest before sending when a
        field breaks the contract's rules. With `owner_id` and `correlation_id`, retried
        as the client's `retry` says."""
        request = _lease_request(
            kind,
            gpu,
            ttl_seconds,
            owner_id,
            correlation_id,
            region,
            env,
            wait_seconds,
            priority_class,
        )
        call = self._core.acquire_call(request)
        retries = _AcquireRetries(self._retry, request)
        for attempt in retries:
            with attempt:
                retries.starting(attempt)
                acquired = self._send(call)
        lease = acquired.lease
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

    def usage(
        self, group_by: GroupBy = "owner", *, since: str | None = None, until: str | None = None
    ) -> UsageReport:
        """Leases, lease-hours and cost per group over [since, until) (RFC 3339 times or
        dates; the server's defaults: the last 24 h)."""
        return self._send(self._core.usage_call(group_by, since, until))

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
        priority_class: str | None = None,
        on_lost: OnLost | None = None,
        on_preempt: OnPreempt | None = None,
        listen: bool = True,
    ) -> Iterator[HeldLease]:
        """Hold a worker for the block: acquire, renew every third of the TTL from a daemon
        thread, release on exit (also when the block raises; then a failing release is
        logged, not raised, so the block's own exception comes through). When the lease
        is found gone, `held.lost` turns true and `on_lost(lease_id, reason)` is called
        (see `HeldLease`); the block is not interrupted.

        With `listen` (the default), another daemon thread follows the lease's event
        stream (docs/concepts/lease-events.md#in-the-clients), opened again with backoff if
        it drops: a preemption is heard at once, `held.preempting` turns true and
        `on_preempt(notice)` is called from that thread; leave the block then, and its
        release frees the room for the preemptor at once. `listen=False`: only the
        renewals hear of changes, at most a third of the TTL late."""
        lease = self.acquire(
            kind,
            gpu=gpu,
            ttl_seconds=ttl_seconds,
            owner_id=owner_id,
            correlation_id=correlation_id,
            region=region,
            env=env,
            wait_seconds=wait_seconds,
            priority_class=priority_class,
        )
        held = HeldLease(lease, on_lost, on_preempt)
        stop = threading.Event()
        renewer = threading.Thread(
            target=self._keep_renewed,
            args=(held, ttl_seconds, stop),
            name=f"renew-lease-{lease.lease_id[:8]}",
            daemon=True,
        )
        renewer.start()
        if listen:
            # Never joined: it ends with the lease's `released` (the release below), or
            # at its next keep-alive once `stop` is set.
            threading.Thread(
                target=self._listen,
                args=(held, stop),
                name=f"lease-events-{lease.lease_id[:8]}",
                daemon=True,
            ).start()
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
                call.method,
                call.path,
                params=call.params,
                json=call.json,
                headers=call.headers,
                timeout=call.timeout or httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.RequestError as exc:
            raise self._core.unreachable(exc) from None
        return _decode(response, call)

    def _keep_renewed(self, held: HeldLease, ttl: int, stop: threading.Event) -> None:
        delay = _renew_every(ttl)
        while not stop.wait(delay) and _keeps_renewing(held):
            try:
                held.lease = self.renew(held.lease_id, ttl_seconds=ttl)
            except SchedulerError as exc:
                if not _renewal_failed(held, exc):
                    if held.lost:
                        _lost(held, self._looked_up(held.lease_id))
                    return
                delay = _retry_every(ttl)
            else:
                _renewed(held)
                delay = _renew_every(ttl)

    def _listen(self, held: HeldLease, stop: threading.Event) -> None:
        call = self._core.events_call(held.lease_id, stream_timeout(self._core.timeout))
        backoff = RECONNECT_FIRST_S
        while not stop.is_set():
            try:
                with self._http.stream(
                    call.method, call.path, headers=call.headers, timeout=call.timeout
                ) as response:
                    if not response.is_success:
                        response.read()
                        _decode(response, call)  # raises the answer's error
                    reader = EventReader()
                    for line in response.iter_lines():
                        event = reader.line(line)
                        if event is None:
                            continue
                        backoff = RECONNECT_FIRST_S
                        # Once the block is over, what comes is the block's own release.
                        if stop.is_set() or heard(held, *event):
                            return
            except SchedulerError as exc:
                if gives_up(held, exc):
                    return
            except httpx.HTTPError:
                pass  # dropped, timed out, refused: opened again after the backoff
            except Exception:
                if not stop.is_set():  # not the client closed under it after the block
                    log.exception("lease %s: listening to its events failed", held.lease_id)
                return
            stop.wait(backoff)
            backoff = next_backoff(backoff)

    def _looked_up(self, lease_id: str) -> Lease | None:
        try:
            return self.get(lease_id)
        except SchedulerError:
            return None

    def _release_held(self, held: HeldLease) -> None:
        if not _needs_release(held):
            return
        with _release_done():
            self.release(held.lease_id)
