"""The asyncio scheduler client, `AsyncSchedulerClient`: the methods of `SchedulerClient`,
awaited, on an `httpx.AsyncClient`, and `lease()` as an async context manager that renews
from a task. Requests are built by `core.py` and answers decoded by `decoding.py`, the
same as for the blocking client in `sync.py`."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import TypeVar

import httpx

from openalice_scheduler.client.core import DEFAULT_TIMEOUT_S, States, _Call, _Core, _lease_request
from openalice_scheduler.client.decoding import _decode
from openalice_scheduler.client.renewal import (
    HeldLease,
    _cancel,
    _logged,
    _release_done,
    _renew_every,
    _renewal_failed,
    _renewed,
    _retry_every,
)
from openalice_scheduler.errors import SchedulerError
from openalice_scheduler.models import GpuClass, Health, Lease, ProviderView, WorkerKind

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
