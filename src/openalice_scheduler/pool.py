"""Warm pools (README, Warm pools): WARM_POOL idle, ready workers per kind and GPU class,
kept in the store as lease rows with no owner (store/pool.py).

The loop keeps each target filled: woken at start, after each take or recycle, and every
few seconds, it recycles idle workers past WARM_POOL_MAX_IDLE_SECONDS (or beyond their
target), then provisions the missing ones on the policy's provider order, probes each
ready and records it idle. An acquire takes the oldest idle worker of its kind and GPU
class, hands it the lease (handoff.py), and the lease is active; a worker that fails its
hand-off is destroyed and the acquire goes on cold."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from opentelemetry.trace import Status, StatusCode
from prometheus_client import Gauge

from openalice_scheduler.errors import ProviderError
from openalice_scheduler.handoff import HandOff
from openalice_scheduler.ids import new_lease_id
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.loops import LoopService
from openalice_scheduler.models import GpuClass, LeaseRequest, WorkerKind
from openalice_scheduler.providers import (
    InstantProvider,
    Provider,
    WorkerSpec,
    reservation_terms,
)
from openalice_scheduler.store import AtCapacity, LeaseRecord, NewLease, to_us
from openalice_scheduler.store.pool import PoolStore
from openalice_scheduler.tracing import span_attributes

if TYPE_CHECKING:
    from openalice_scheduler.service import LeaseService

log = logging.getLogger(__name__)

REFILL_INTERVAL_S = 2.0
# With WARM_POOL unset there is nothing to fill: the first pass recycles what an earlier
# run left, and later ones only look (a store read) this seldom.
UNSET_INTERVAL_S = 60.0
REFILL_AFTER_TAKE_S = 0.1
# After a pool's provision failed, it is tried again after this long, doubling.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
# How often each idle worker's probe is tried again: one that stopped answering is
# replaced before an acquire is handed it.
CHECK_EVERY_S = 10.0

Key = tuple[str, str]  # (kind, gpu)


class WarmPool(LoopService):
    name = "warm-pool"

    def __init__(
        self,
        service: LeaseService,
        targets: dict[Key, int],
        handoff: HandOff,
        *,
        max_idle_seconds: float,
        idle_gauge: Gauge,
        interval: float = REFILL_INTERVAL_S,
    ) -> None:
        super().__init__(interval if any(n > 0 for n in targets.values()) else UNSET_INTERVAL_S)
        self.service = service
        self.store = PoolStore(service.store)
        self.targets = {key: n for key, n in targets.items() if n > 0}
        self.handoff = handoff
        self.max_idle_us = int(max_idle_seconds * 1e6)
        self.idle_gauge = idle_gauge
        # Kinds whose workers have no hand-off (404, handoff.NO_HANDOFF): not used warm.
        self.disabled: set[str] = set()
        self._retry_at: dict[Key, float] = {}
        self._backoff: dict[Key, float] = {}
        self._checked_at = 0.0
        for kind, gpu in self.targets:
            idle_gauge.labels(kind, gpu).set(0)
        if self.targets:
            handoff.open()

    # --- the loop --------------------------------------------------------------------

    async def run_once(self) -> dict[str, int]:
        """Recycle what is stale or surplus, then fill each target."""
        recycled = await self._recycle_stale()
        have: dict[Key, int] = {}
        for count in await self.store.counts():
            key = (count.kind, count.gpu)
            have[key] = have.get(key, 0) + count.count
        now = time.monotonic()
        work = [
            self._warm_one(key, target)
            for key, target in self.targets.items()
            if key[0] not in self.disabled and now >= self._retry_at.get(key, 0)
            for _ in range(target - have.get(key, 0))
        ]
        made = sum(await asyncio.gather(*work))
        await self._show_idle()
        return {"recycled": recycled, "warmed": made}

    async def _recycle_stale(self) -> int:
        now = self.service.now_us()
        kept: dict[Key, int] = {}
        recycled = 0
        alive: list[LeaseRecord] = []
        for record in await self.store.idle():
            key = (record.kind, record.gpu)
            target = 0 if record.kind in self.disabled else self.targets.get(key, 0)
            kept[key] = kept.get(key, 0) + 1
            if record.expires_at <= now or kept[key] > target:
                recycled += await self._recycle(record.lease_id)
            else:
                alive.append(record)
        if time.monotonic() - self._checked_at >= CHECK_EVERY_S:
            self._checked_at = time.monotonic()
            problems = await asyncio.gather(
                *(self.service.probe.check(r.kind, r.probe_url or r.endpoint) for r in alive)
            )
            for record, problem in zip(alive, problems, strict=True):
                if problem is not None:
                    log.warning(
                        "pool worker %s stopped answering (%s); replaced",
                        lease_ref(record),
                        problem,
                    )
                    recycled += await self._recycle(record.lease_id)
        return recycled

    async def _recycle(self, lease_id: str) -> int:
        claimed = await self.store.recycle(lease_id, now=self.service.now_us())
        if claimed is None:
            return 0  # taken (or resolved) meanwhile
        log.info("pool worker %s recycled", lease_ref(claimed))
        await self.service.destroy(claimed)
        self.wake()
        return 1

    async def _warm_one(self, key: Key, target: int) -> int:
        """One pool worker made, probed and recorded idle: 1, else 0."""
        kind, gpu = key
        lease_id = new_lease_id()
        now = self.service.clock()
        expires = now + timedelta(microseconds=self.max_idle_us)
        spec = WorkerSpec(
            lease_id=lease_id,
            kind=WorkerKind(kind),
            gpu=GpuClass(gpu),
            expires_at=expires,
            store_id=self.service.store.store_id,
        )
        new = NewLease(
            lease_id=lease_id,
            kind=kind,
            gpu=gpu,
            owner_id=None,
            correlation_id=None,
            region=None,
            ttl_seconds=math.ceil(self.max_idle_us / 1e6),
            created_at=to_us(now),
            expires_at=to_us(expires),
        )
        self.service.in_flight.add(lease_id)
        try:
            for provider in await self.service.policy.order(self.service.providers, spec):
                if isinstance(provider, InstantProvider):
                    continue  # static endpoints are always there: nothing to keep warm
                if not (await provider.available(spec)).ok:
                    continue
                terms = reservation_terms(
                    provider,
                    spec,
                    now=self.service.now_us(),
                    owner_quota=0,
                    price=await provider.price(spec),
                )
                try:
                    reserved = await self.store.reserve(new, provider.name, terms, target)
                except AtCapacity:
                    continue  # pool workers never take what the cap does not allow
                if reserved is None:
                    return 0  # full: another pass or replica filled it meanwhile
                return await self._make(provider, reserved, spec)
            return 0
        finally:
            self.service.in_flight.discard(lease_id)

    async def _make(self, provider: Provider, reserved: LeaseRecord, spec: WorkerSpec) -> int:
        key = (spec.kind.value, spec.gpu.value)
        service = self.service
        # Its idle fence and credential from the start: a worker that serves no lease yet
        # can ask after its own row too (and stops itself when the pool is gone).
        spec = WorkerSpec(
            lease_id=spec.lease_id,
            kind=spec.kind,
            gpu=spec.gpu,
            expires_at=spec.expires_at,
            store_id=spec.store_id,
            resource=reserved.resource,
            fence=reserved.fence,
            **service.access.spec_fields(spec.lease_id),
        )
        started = time.perf_counter()
        try:
            worker = await asyncio.wait_for(
                provider.provision(spec), timeout=service.provision_timeout
            )
            await service.probe.wait(provider.name, spec, worker, since=started)
        except (ProviderError, TimeoutError) as exc:
            why = exc.message if isinstance(exc, ProviderError) else "provision timed out"
            log.warning(
                "pool worker %s (%s/%s) failed on %s: %s", lease_ref(spec), *key, provider.name, why
            )
            self._failed(key)
            await service.store.fail(spec.lease_id, error=why, now=service.now_us())
            await _destroy_quietly(provider, spec.lease_id)
            service.capacity_freed()
            return 0
        ready = await self.store.ready(
            spec.lease_id,
            endpoint=worker.endpoint,
            provider_token=worker.provider_token,
            probe_url=worker.probe_url,
            now=service.now_us(),
            gpu_type=worker.gpu_type,
            price_per_hour=worker.price_per_hour,
        )
        if ready is None:  # resolved by reconciliation meanwhile
            await _destroy_quietly(provider, spec.lease_id, worker.provider_token)
            return 0
        self._backoff.pop(key, None)
        log.info("pool worker %s (%s/%s) idle on %s", lease_ref(ready), *key, provider.name)
        return 1

    def _failed(self, key: Key) -> None:
        wait = min(MAX_BACKOFF_S, self._backoff.get(key, FIRST_BACKOFF_S / 2) * 2)
        self._backoff[key] = wait
        self._retry_at[key] = time.monotonic() + wait

    async def _show_idle(self) -> None:
        idle: dict[Key, int] = dict.fromkeys(self.targets, 0)
        for count in await self.store.counts():
            if count.state == "idle":
                key = (count.kind, count.gpu)
                idle[key] = idle.get(key, 0) + count.count
        for (kind, gpu), n in idle.items():
            self.idle_gauge.labels(kind, gpu).set(n)

    # --- what the service asks -------------------------------------------------------

    async def take(self, request: LeaseRequest) -> LeaseRecord | None:
        """An idle worker for `request`, handed off and active; None when the pool has
        none (or its worker failed the hand-off): the acquire then goes cold. Raises as
        a cold reserve does for the owner's quota and a duplicate request."""
        kind, gpu = request.kind.value, request.gpu.value
        if request.region is not None or kind in self.disabled or (kind, gpu) not in self.targets:
            return None
        service = self.service
        now = service.now_us()
        claimed = await self.store.claim(
            NewLease(
                lease_id=new_lease_id(),
                kind=kind,
                gpu=gpu,
                owner_id=request.owner_id,
                correlation_id=request.correlation_id,
                region=None,
                ttl_seconds=request.ttl_seconds,
                created_at=now,
                expires_at=now + request.ttl_seconds * 1_000_000,
            ),
            service.max_leases_per_owner,
            service.budgets.of(request.owner_id),
        )
        if claimed is None:
            return None
        self.idle_gauge.labels(kind, gpu).dec()  # the next pass sets it from the store
        # Refill in the background, just after this burst of takes rather than inside it:
        # the pool's provisions would compete with the hand-offs for this process's CPU.
        asyncio.get_running_loop().call_later(REFILL_AFTER_TAKE_S, self.wake)
        service.in_flight.add(claimed.lease_id)
        try:
            attributes = span_attributes(
                claimed.lease_id, claimed.provider, claimed.kind, claimed.correlation_id
            )  # never the env
            with service.tracer.start_as_current_span("handoff", attributes=attributes) as span:
                outcome = await self.handoff.send(claimed, request.env)
                if not outcome.ok:
                    span.set_status(Status(StatusCode.ERROR, outcome.problem))
            if outcome.ok:
                record = await service.store.activate(
                    claimed.lease_id,
                    endpoint=claimed.endpoint,
                    provider_token=claimed.provider_token,
                    now=service.now_us(),
                )
                if record is not None:
                    return record
                why = "resolved by reconciliation while handing off"
            elif outcome.unsupported:
                if kind not in self.disabled:
                    self.disabled.add(kind)
                    log.warning(
                        "pool workers of kind %s answer their hand-off (%s) 404: "
                        "the %s pool is switched off, those acquires go cold",
                        kind,
                        self.handoff.path,
                        kind,
                    )
                why = outcome.problem
            else:
                why = outcome.problem
            log.warning(
                "lease %s: hand-off to pool worker failed (%s); destroyed, going cold",
                lease_ref(claimed),
                why,
            )
            await service.store.fail(
                claimed.lease_id, error=f"hand-off failed: {why}", now=service.now_us()
            )
            provider = service.by_name.get(claimed.provider)
            if provider is not None:
                await _destroy_quietly(provider, claimed.lease_id, claimed.provider_token)
            service.capacity_freed()
            return None
        finally:
            service.in_flight.discard(claimed.lease_id)

    async def make_room(self, provider: str, gpu: str) -> bool:
        """Destroy one idle pool worker of `provider` (of class `gpu` first): a cold
        acquire needs the room. Whether one was destroyed."""
        for lease_id in await self.store.room_on(provider, gpu):
            if await self._recycle(lease_id):
                return True
        return False

    async def hand_on(self, record: LeaseRecord) -> None:
        """Tell a warm lease's worker its new expiry; a failure is logged only: the
        renewal stands (the worker was told LEASE_EXPIRES_AT's successor, or not)."""
        outcome = await self.handoff.send(record, None)
        if not outcome.ok:
            log.warning(
                "lease %s: renewal not handed on to its worker (%s)",
                lease_ref(record),
                outcome.problem,
            )

    async def stop(self, timeout: float = 10.0) -> None:
        await super().stop(timeout)
        await self.handoff.close()


async def _destroy_quietly(provider: Provider, lease_id: str, token: str = "") -> None:
    try:
        await provider.release(token, lease_id)
    except ProviderError as exc:
        # The reconciler destroys it later as an orphan: it carries our labels.
        log.warning(
            "lease %s: could not clean up on %s yet: %s",
            lease_ref(lease_id),
            provider.name,
            exc.message,
        )
