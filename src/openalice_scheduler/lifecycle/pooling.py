"""Warm pools (docs/concepts/pools.md#warm-pools): WARM_POOL idle, ready workers per kind and GPU
class, kept in the store as lease rows with no owner (store/pool.py). The pool is one of the
supplies an acquire tries (acquiring.py), the first: a faster way to get a provider's worker,
through the same path as a cold one. A pool may serve only some priority classes.

Kept filled by a loop (loops/warm.py) that calls `refill`: it recycles idle workers past
WARM_POOL_MAX_IDLE_SECONDS or that stopped answering; on the replica that sizes the pools
(the admission loop's leader: one sizing for the cluster), it sets each pool's target
(pool_sizing.py: its demand, bounds and money caps), recycles idle workers beyond it and
makes the missing ones on the policy's provider order (making.py), recording each idle.
An acquire takes the oldest idle worker of its kind and GPU class, hands it the lease
(handoff.py), and the lease is active; a worker that fails its hand-off is destroyed and
the acquire goes on cold."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from datetime import timedelta

from opentelemetry.trace import Status, StatusCode
from prometheus_client import Gauge

from openalice_scheduler import timings
from openalice_scheduler.errors import ProviderError
from openalice_scheduler.handoff import HandOff
from openalice_scheduler.ids import new_lease_id
from openalice_scheduler.lifecycle import admission, states
from openalice_scheduler.lifecycle.admission import reservation_terms
from openalice_scheduler.lifecycle.attempt import Attempt
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.ending import Ending
from openalice_scheduler.lifecycle.making import destroy_quietly, make_worker
from openalice_scheduler.lifecycle.pool_sizing import Plan, Sizing
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.models import GpuClass, LeaseRequest, LeaseState, WorkerKind
from openalice_scheduler.providers import BoundedProvider, InstantProvider, Provider, WorkerSpec
from openalice_scheduler.store import AtCapacity, Behind, LeaseRecord, NewLease, OverBudget
from openalice_scheduler.store.pool import PoolCount, PoolStore
from openalice_scheduler.times import to_us
from openalice_scheduler.tracing import span_attributes

# The pool's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.pool")

# After a pool's provision failed, it is tried again after this long, doubling.
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
# How often each idle worker's probe is tried again: one that stopped answering is
# replaced before an acquire is handed it.
CHECK_EVERY_S = 10.0

Key = tuple[str, str]  # (kind, gpu)


class Pool:
    def __init__(
        self,
        core: Core,
        ending: Ending,
        plans: dict[Key, Plan],
        handoff: HandOff,
        *,
        max_idle_seconds: float,
        idle_gauge: Gauge,
        max_cost_per_hour: float | None = None,
    ) -> None:
        self.core = core
        self.ending = ending
        self.store = PoolStore(core.store)
        # The longest TTL a pool worker may serve: a provider that ends its workers
        # itself (BoundedProvider) bounds its leases; a longer request goes cold, where
        # each provider says whether it can serve it.
        self.max_ttl_s = min(
            (p.max_lifetime_seconds for p in core.providers if isinstance(p, BoundedProvider)),
            default=math.inf,
        )
        self.plans = {key: plan for key, plan in plans.items() if plan.shape.max > 0}
        self.sizing = Sizing(core, self.store, self.plans, max_cost_per_hour=max_cost_per_hour)
        # Each pool's workers to keep, as last sized (`refill` on the sizing replica).
        self.targets: dict[Key, int] = {}
        # Whether this replica sizes the pools (the admission loop's leader).
        self.sizes: Callable[[], bool] = lambda: True
        self.handoff = handoff
        self.max_idle_us = int(max_idle_seconds * 1e6)
        self.idle_gauge = idle_gauge
        # Called when a worker was taken (its hand-off over) or recycled: the loop refills
        # soon (loops/warm.py).
        self.on_taken: Callable[[], None] = lambda: None
        # Kinds whose workers have no hand-off (404, handoff.NO_HANDOFF): not used warm.
        self.disabled: set[str] = set()
        self._retry_at: dict[Key, float] = {}
        self._backoff: dict[Key, float] = {}
        self._checked_at = 0.0
        self._counted_at: float | None = None
        for kind, gpu in self.plans:
            idle_gauge.labels(kind, gpu).set(0)
            core.metrics.pool_target.labels(kind, gpu).set(0)
            core.metrics.pool_hits.labels(kind, gpu)
            core.metrics.pool_misses.labels(kind, gpu)
            core.metrics.pool_idle_seconds.labels(kind, gpu)
            core.metrics.pool_idle_cost.labels(kind, gpu)
        if self.plans:
            handoff.open()

    # --- kept filled -----------------------------------------------------------------

    async def refill(self) -> dict[str, int]:
        """Recycle what is stale; on the sizing replica, size each pool, recycle what is
        beyond its target and fill it."""
        sizing = self.sizes()
        # Another replica's targets are shown by it alone: here 0 (read with `max`).
        self.targets = await self.sizing.targets() if sizing else {}
        for kind, gpu in self.plans:
            self.core.metrics.pool_target.labels(kind, gpu).set(self.targets.get((kind, gpu), 0))
        recycled = await self._recycle_stale(surplus=sizing)
        if not sizing:
            await self._show_idle()
            return {"recycled": recycled, "warmed": 0}
        have: dict[Key, int] = {}
        counts = await self.store.counts()
        for count in counts:
            key = (count.kind, count.gpu)
            have[key] = have.get(key, 0) + count.count
        now = self.core.clock.monotonic()
        self._account(counts, now)
        work = [
            self._warm_one(key, target)
            for key, target in self.targets.items()
            if key[0] not in self.disabled and now >= self._retry_at.get(key, 0)
            for _ in range(target - have.get(key, 0))
        ]
        made = sum(await asyncio.gather(*work))
        await self._show_idle()
        return {"recycled": recycled, "warmed": made}

    def _account(self, counts: list[PoolCount], now: float) -> None:
        """What the pools' workers cost since the last pass (on the sizing replica only,
        so the cluster's figures are the sum over replicas): idle worker-seconds, and
        idle and warming workers at their pool's price."""
        elapsed = 0.0 if self._counted_at is None else now - self._counted_at
        self._counted_at = now
        metrics = self.core.metrics
        for count in counts:
            key = (count.kind, count.gpu)
            if count.state == LeaseState.idle:
                metrics.pool_idle_seconds.labels(*key).inc(count.count * elapsed)
            price = self.sizing.price.get(key) or 0.0
            metrics.pool_idle_cost.labels(*key).inc(count.count * elapsed * price / 3600)

    async def _recycle_stale(self, *, surplus: bool) -> int:
        """Recycle idle workers past their time, beyond their pool's target (`surplus`:
        only the replica that sized the pools knows it) or that stopped answering."""
        now = self.core.now_us()
        kept: dict[Key, int] = {}
        recycled = 0
        alive: list[LeaseRecord] = []
        for record in await self.store.idle():
            key = (record.kind, record.gpu)
            target = 0 if record.kind in self.disabled else self.targets.get(key, 0)
            kept[key] = kept.get(key, 0) + 1
            if record.expires_at <= now or (surplus and kept[key] > target):
                recycled += await self._recycle(record.lease_id)
            else:
                alive.append(record)
        if self.core.clock.monotonic() - self._checked_at >= CHECK_EVERY_S:
            self._checked_at = self.core.clock.monotonic()
            problems = await asyncio.gather(
                *(self.core.probe.check(r.kind, r.probe_url or r.endpoint) for r in alive)
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
        claimed = await self._claim(lease_id)
        if claimed is None:
            return 0  # taken (or resolved) meanwhile
        await self.destroy(claimed)
        return 1

    async def _claim(self, lease_id: str) -> LeaseRecord | None:
        """The idle worker claimed for one destroy attempt (`releasing`, reason
        `recycled`); None when taken or resolved meanwhile."""
        claimed = await self.store.recycle(lease_id, states.RECYCLE, now=self.core.now_us())
        if claimed is not None:
            log.info("pool worker %s recycled", lease_ref(claimed))
        return claimed

    async def _warm_one(self, key: Key, target: int) -> int:
        """One pool worker made, probed and recorded idle: 1, else 0."""
        kind, gpu = key
        lease_id = new_lease_id()
        now = self.core.clock.now()
        expires = now + timedelta(microseconds=self.max_idle_us)
        spec = WorkerSpec(
            lease_id=lease_id,
            kind=WorkerKind(kind),
            gpu=GpuClass(gpu),
            expires_at=expires,
            store_id=self.core.store.store_id,
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
            pooled_at=to_us(now),
        )
        self.core.in_flight.add(lease_id)
        try:
            for provider in await self.core.policy.order(self.core.providers, spec):
                if isinstance(provider, InstantProvider):
                    continue  # static endpoints are always there: nothing to keep warm
                if not (await provider.available(spec)).ok:
                    continue
                price = await provider.price(spec)
                self.sizing.priced(key, price)
                terms = reservation_terms(
                    provider,
                    spec,
                    now=self.core.now_us(),
                    owner_quota=0,
                    price=price,
                )
                try:
                    reserved = await self.core.store.reserve(
                        new,
                        admission.reserve_warm(
                            new,
                            provider.name,
                            terms,
                            target,
                            states.WARM,
                            self.core.first_in_line(),
                        ),
                    )
                except Behind:
                    return 0  # callers wait in line: a refill takes no room before them
                except AtCapacity:
                    continue  # pool workers never take what the cap does not allow
                if reserved is None:
                    return 0  # full: another pass or replica filled it meanwhile
                return await self._make(provider, reserved, spec)
            return 0
        finally:
            self.core.in_flight.discard(lease_id)

    async def _make(self, provider: Provider, reserved: LeaseRecord, spec: WorkerSpec) -> int:
        key = (spec.kind.value, spec.gpu.value)
        core = self.core
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
            **core.access.spec_fields(spec.lease_id),
        )
        try:
            worker = await make_worker(core, provider, spec)
        except ProviderError as exc:
            log.warning(
                "pool worker %s (%s/%s) failed on %s: %s",
                lease_ref(spec),
                *key,
                provider.name,
                exc.message,
            )
            self._failed(key)
            await core.store.fail(spec.lease_id, states.FAIL, error=exc.message, now=core.now_us())
            core.capacity_freed()
            return 0
        ready = await self.store.ready(
            spec.lease_id,
            states.READY,
            endpoint=worker.endpoint,
            provider_token=worker.provider_token,
            probe_url=worker.probe_url,
            now=core.now_us(),
            gpu_type=worker.gpu_type,
            price_per_hour=worker.price_per_hour,
        )
        if ready is None:  # resolved by reconciliation, or cancelled, meanwhile
            await destroy_quietly(provider, spec.lease_id, worker.provider_token)
            return 0
        self._backoff.pop(key, None)
        log.info("pool worker %s (%s/%s) idle on %s", lease_ref(ready), *key, provider.name)
        await core.announce_freed()  # a caller in line may take it
        return 1

    def _failed(self, key: Key) -> None:
        wait = min(MAX_BACKOFF_S, self._backoff.get(key, FIRST_BACKOFF_S / 2) * 2)
        self._backoff[key] = wait
        self._retry_at[key] = self.core.clock.monotonic() + wait

    async def _show_idle(self) -> None:
        idle: dict[Key, int] = dict.fromkeys(self.plans, 0)
        for count in await self.store.counts():
            if count.state == LeaseState.idle:
                key = (count.kind, count.gpu)
                idle[key] = idle.get(key, 0) + count.count
        for (kind, gpu), n in idle.items():
            self.idle_gauge.labels(kind, gpu).set(n)

    # --- a supply of the acquire path --------------------------------------------------

    def serves(self, request: LeaseRequest, priority_class: str) -> bool:
        """Whether the pool keeps workers for `request` of a caller of `priority_class`:
        its kind and GPU class have a pool for that class, their hand-off works, it asks
        for no region (the pool's have none), and its TTL is within what a pool worker may
        serve (`max_ttl_s`)."""
        kind, gpu = request.kind.value, request.gpu.value
        plan = self.plans.get((kind, gpu))
        return (
            plan is not None
            and plan.serves_class(priority_class)
            and request.region is None
            and kind not in self.disabled
            and request.ttl_seconds <= self.max_ttl_s
        )

    def missed(self, request: LeaseRequest) -> None:
        """An acquire the pool serves went cold."""
        self.core.metrics.pool_misses.labels(request.kind.value, request.gpu.value).inc()

    async def obtain(self, attempt: Attempt) -> LeaseRecord | None:
        """An idle worker for the attempt's request, handed off and active; None when the
        pool has none, when its worker failed the hand-off (the acquire goes on cold), or
        when it would break the owner's caps in money (noted in the attempt: a cheaper
        provider may serve cold). Raises as a cold reserve does for the owner's quota
        and a duplicate request."""
        request = attempt.request
        kind, gpu = request.kind.value, request.gpu.value
        core = self.core
        now = core.now_us()
        try:
            lease = NewLease(
                lease_id=new_lease_id(),
                kind=kind,
                gpu=gpu,
                owner_id=request.owner_id,
                correlation_id=request.correlation_id,
                region=None,
                ttl_seconds=request.ttl_seconds,
                created_at=now,
                expires_at=now + request.ttl_seconds * 1_000_000,
                priority_class=attempt.priority_class,
                requested_at=now,
            )
            claimed = await self.store.claim(
                lease,
                admission.claim_idle(
                    lease,
                    core.max_leases_per_owner,
                    core.budgets.of(request.owner_id),
                    states.CLAIM,
                    core.first_in_line(),
                ),
            )
        except OverBudget as exc:
            attempt.over_budget.append(exc)
            return None
        except Behind:
            attempt.behind = attempt.at_capacity = True  # the line is served first
            return None
        if claimed is None:
            return None
        return await self.hand_off(claimed, request)

    async def hand_off(self, claimed: LeaseRecord, request: LeaseRequest) -> LeaseRecord | None:
        """The claimed pool worker handed the lease, which is then `active`; None when
        its hand-off failed (destroyed: the acquire goes on cold)."""
        core = self.core
        kind, gpu = claimed.kind, claimed.gpu
        self.idle_gauge.labels(kind, gpu).dec()  # the next pass sets it from the store
        core.in_flight.add(claimed.lease_id)
        try:
            attributes = span_attributes(
                claimed.lease_id, claimed.provider, claimed.kind, claimed.correlation_id
            )  # never the env
            with core.tracer.start_as_current_span("handoff", attributes=attributes) as span:
                with timings.on_worker("warm"):
                    outcome = await self.handoff.send(claimed, request.env)
                if not outcome.ok:
                    span.set_status(Status(StatusCode.ERROR, outcome.problem))
            if outcome.ok:
                record = await core.store.activate(
                    claimed.lease_id,
                    states.ACTIVATE,
                    endpoint=claimed.endpoint,
                    provider_token=claimed.provider_token,
                    now=core.now_us(),
                )
                if record is not None:
                    core.metrics.pool_hits.labels(kind, gpu).inc()
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
            await core.store.fail(
                claimed.lease_id, states.FAIL, error=f"hand-off failed: {why}", now=core.now_us()
            )
            provider = core.by_name.get(claimed.provider)
            if provider is not None:
                await destroy_quietly(provider, claimed.lease_id, claimed.provider_token)
            core.capacity_freed()
            return None
        finally:
            core.in_flight.discard(claimed.lease_id)
            # Refilled in the background once this burst of takes is answered (the loop
            # waits for a pause): inside it, the pool's provisions would compete with
            # the hand-offs for this process's CPU.
            self.on_taken()

    async def give_up(self, record: LeaseRecord) -> bool:
        """A pool worker's room given to a caller in line (admitting.py): an idle one
        recycled, a warming one cancelled (its row failed at once, so the room counts
        free; its worker is destroyed as soon as its start returns, in `_make`).
        Whether it was."""
        if record.state == LeaseState.idle:
            return bool(await self._recycle(record.lease_id))
        cancelled = await self.core.store.fail(
            record.lease_id,
            states.FAIL,
            error="cancelled: its room went to a caller in line",
            now=self.core.now_us(),
        )
        return cancelled is not None

    async def give_room(self, provider: str, gpu: str) -> LeaseRecord | None:
        """For a cold acquire at capacity on `provider`: an idle pool worker there (of
        class `gpu` first) claimed for destruction, its room still counted until the
        acquire's reservation takes it over (admission.reserve's `freeing`), so that no
        pool pass, on any replica, takes it in between; `destroy` then destroys it. None
        when there is none."""
        for lease_id in await self.store.room_on(provider, gpu):
            claimed = await self._claim(lease_id)
            if claimed is not None:
                return claimed
        return None

    async def destroy(self, claimed: LeaseRecord) -> str | None:
        """A claimed pool worker destroyed: None when it is gone, else why not (its
        release is retried, and it holds its room and device meanwhile)."""
        problem = await self.ending.destroy(claimed)
        self.on_taken()
        return problem

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

    async def close(self) -> None:
        await self.handoff.close()
