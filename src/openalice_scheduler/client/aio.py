"""The asyncio scheduler client, `AsyncSchedulerClient`: the methods of `SchedulerClient`,
awaited, on an `httpx.AsyncClient`, and `lease()` as an async context manager that renews
from a task and listens to the lease's events from another. Requests are built by
`core.py` and answers decoded by `decoding.py`, the same as for the blocking client in
`sync.py`."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncIterator, Mapping
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
    LeaseLost,
    OnLost,
    OnPreempt,
    _cancel,
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


class AsyncSchedulerClient:
    """The asyncio twin of `SchedulerClient`: the same methods, awaited; `lease()` is an
    async context manager that renews from a task."""

    def __init__(
        self,
        url: str | None = None,
        secret: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry: RetryPolicy | None = RetryPolicy(),
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._core = _Core(url, secret, timeout)
        self._retry = retry
        self._http = httpx.AsyncClient(
            base_url=self._core.url,
            headers=self._core.auth,
            timeout=timeout,
            limits=LIMITS,
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
        priority_class: str | None = None,
    ) -> Lease:
        """See `SchedulerClient.acquire`."""
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
        async for attempt in retries:
            with attempt:
                retries.starting(attempt)
                acquired = await self._send(call)
        lease = acquired.lease
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

    async def usage(
        self, group_by: GroupBy = "owner", *, since: str | None = None, until: str | None = None
    ) -> UsageReport:
        """Leases, lease-hours and cost per group over [since, until) (RFC 3339 times or
        dates; the server's defaults: the last 24 h)."""
        return await self._send(self._core.usage_call(group_by, since, until))

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
        priority_class: str | None = None,
        on_lost: OnLost | None = None,
        on_preempt: OnPreempt | None = None,
        listen: bool = True,
        cancel_on_lost: bool = False,
    ) -> AsyncIterator[HeldLease]:
        """See `SchedulerClient.lease`; the renewals run in a task, and with `listen` (the
        default) the lease's events are followed from another
        (docs/concepts/lease-events.md#in-the-clients): `on_preempt` and `on_lost` are called
        in the event loop. With `cancel_on_lost`, a lease found gone also cancels
        the task running the block: the block sees `CancelledError` at its next await
        (its `finally` clauses run), and the `async with` then raises `LeaseLost` in its
        place, the way `asyncio.timeout()` raises TimeoutError. A cancellation from
        elsewhere still comes through as `CancelledError`."""
        lease = await self.acquire(
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
        block = _Block(cancel_on_lost)
        renewer = asyncio.create_task(
            self._keep_renewed(held, ttl_seconds, block), name=f"renew-lease-{lease.lease_id[:8]}"
        )
        listener = (
            asyncio.create_task(
                self._listen(held, block), name=f"lease-events-{lease.lease_id[:8]}"
            )
            if listen
            else None
        )
        try:
            yield held
        except BaseException as exc:
            block.running = False
            if listener is not None:
                await _cancel(listener)
            await _cancel(renewer)
            with _logged(held, "release"):
                await self._release_held(held)
            if block.took_back_its_cancel() and isinstance(exc, asyncio.CancelledError):
                raise LeaseLost(held.lease_id, held.lost_reason or "") from None
            raise
        block.running = False
        block.took_back_its_cancel()  # the block swallowed it: the task's count is ours
        if listener is not None:
            await _cancel(listener)
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

    async def _keep_renewed(self, held: HeldLease, ttl: int, block: _Block) -> None:
        delay = _renew_every(ttl)
        while True:
            await asyncio.sleep(delay)
            if not _keeps_renewing(held):
                return
            try:
                held.lease = await self.renew(held.lease_id, ttl_seconds=ttl)
            except SchedulerError as exc:
                if not _renewal_failed(held, exc):
                    if held.lost:
                        _lost(held, await self._looked_up(held.lease_id))
                        block.cancel()
                    return
                delay = _retry_every(ttl)
            else:
                _renewed(held)
                delay = _renew_every(ttl)

    async def _listen(self, held: HeldLease, block: _Block) -> None:
        call = self._core.events_call(held.lease_id, stream_timeout(self._core.timeout))
        backoff = RECONNECT_FIRST_S
        while True:
            try:
                async with self._http.stream(
                    call.method, call.path, headers=call.headers, timeout=call.timeout
                ) as response:
                    if not response.is_success:
                        await response.aread()
                        _decode(response, call)  # raises the answer's error
                    reader = EventReader()
                    async for line in response.aiter_lines():
                        event = reader.line(line)
                        if event is None:
                            continue
                        backoff = RECONNECT_FIRST_S
                        if heard(held, *event):
                            block.cancel()
                            return
            except SchedulerError as exc:
                if gives_up(held, exc):
                    return
            except httpx.HTTPError:
                pass  # dropped, timed out, refused: opened again after the backoff
            await asyncio.sleep(backoff)
            backoff = next_backoff(backoff)

    async def _looked_up(self, lease_id: str) -> Lease | None:
        try:
            return await self.get(lease_id)
        except SchedulerError:
            return None

    async def _release_held(self, held: HeldLease) -> None:
        if not _needs_release(held):
            return
        with _release_done():
            await self.release(held.lease_id)


class _Block:
    """The task running a `lease()` block, cancelled when the lease is lost if the caller
    asked for it. `running` is cleared as the block ends, before any await, so a lease
    lost during the release never cancels the code after the block."""

    def __init__(self, cancel_on_lost: bool) -> None:
        self.task = asyncio.current_task() if cancel_on_lost else None
        self.cancelling = self.task.cancelling() if self.task is not None else 0
        self.running = True
        self.cancelled = False

    def cancel(self) -> None:
        # Once: the event stream and the renewer may both find the lease gone, and a second
        # cancel() would leave the task cancelled after the one we take back.
        if self.task is not None and self.running and not self.cancelled:
            self.cancelled = True
            self.task.cancel()

    def took_back_its_cancel(self) -> bool:
        """Take back our cancellation, if there was one, as asyncio.timeout() does; whether
        it was the only one (none came from elsewhere meanwhile)."""
        if self.task is None or not self.cancelled:
            return False
        self.cancelled = False
        return self.task.uncancel() <= self.cancelling
