"""LeaseService: the one owner of a lease's life, and the one door to it. Routes call it
for what callers ask (acquire, renew, release, reads); loops find what is due or adrift
and hand each case to it (an expiry, a release to retry, a provision abandoned, an
orphan worker, a worker lost or heard dead, the pool to refill, ended leases to purge).

Its parts, each with one job: acquiring.py (the one acquire path, the warm pool first),
ending.py (every way a lease ends), losing.py (a worker that stopped after its
hand-out), pooling.py (the warm pool), reconciling.py (what a provider's listing means
for its leases), admission.py (who may take capacity), line.py (the callers waiting for
capacity), guards.py (what guards are told), watching.py (who follows a lease's changes)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from opentelemetry.trace import Tracer
from prometheus_client import Gauge

from openalice_scheduler.config import PoolEntry
from openalice_scheduler.errors import (
    LeaseNotFound,
    PastProviderDeadline,
    Preempting,
    ShuttingDown,
    WorkerLost,
)
from openalice_scheduler.handoff import HandOff
from openalice_scheduler.ids import is_lease_id
from openalice_scheduler.lease_access import LeaseAccess
from openalice_scheduler.lifecycle import states
from openalice_scheduler.lifecycle.acquiring import Acquiring
from openalice_scheduler.lifecycle.admission import Budgets, Priorities, check_owner
from openalice_scheduler.lifecycle.admitting import Admitting
from openalice_scheduler.lifecycle.clock import SYSTEM_CLOCK, Clock
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.ending import Ending
from openalice_scheduler.lifecycle.guards import GuardDesk
from openalice_scheduler.lifecycle.line import Line
from openalice_scheduler.lifecycle.losing import Losing
from openalice_scheduler.lifecycle.policy import Policy
from openalice_scheduler.lifecycle.pool_sizing import Plan
from openalice_scheduler.lifecycle.pooling import Key, Pool
from openalice_scheduler.lifecycle.reconciling import Reconciling
from openalice_scheduler.lifecycle.views import provider_view
from openalice_scheduler.lifecycle.watching import LeaseEvent, Watching
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.models import (
    MAX_TTL_SECONDS,
    GroupBy,
    LeaseRequest,
    LeaseState,
    ReleaseReason,
)
from openalice_scheduler.providers import BoundedProvider, Provider, WorkerEnded, WorkerInfo
from openalice_scheduler.providers.probe import ReadyProbe
from openalice_scheduler.store import LeaseRecord, LeaseStore
from openalice_scheduler.store import usage as counting
from openalice_scheduler.times import DAY_US, format_us

# Under this owner, usage shows the warm pools' workers while they wait in the pool.
POOL_OWNER = "pool"

# The service's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.service")


class LeaseService:
    def __init__(
        self,
        store: LeaseStore,
        providers: Sequence[Provider],
        policy: Policy,
        metrics: Metrics,
        tracer: Tracer,
        *,
        provision_timeout: float = 600.0,
        probe: ReadyProbe | None = None,
        max_leases_per_owner: int = 0,
        clock: Clock = SYSTEM_CLOCK,
        on_due: Callable[[int], None] = lambda _at: None,
        access: LeaseAccess | None = None,
        budgets: Budgets | None = None,
        priorities: Priorities | None = None,
        max_waiting: int = 1000,
        max_waiting_per_owner: int = 500,
        replica_timeout: float = 16.0,
        preemption_grace: float = 30.0,
        notices: HandOff | None = None,
        line_aging: float = 120.0,
    ) -> None:
        self.core = Core(
            store=store,
            providers=list(providers),
            policy=policy,
            metrics=metrics,
            tracer=tracer,
            probe=probe or ReadyProbe.off(),  # none given: workers are not probed
            # A worker's credential for its own lease (none: workers are not told one).
            access=access or LeaseAccess("", None),
            # Each owner's caps in money (none given: no caps).
            budgets=budgets or Budgets(),
            # The priority classes (none given: one class, `default`).
            priorities=priorities or Priorities(),
            line=Line(metrics, most=max_waiting, per_owner=max_waiting_per_owner, clock=clock),
            clock=clock,
            on_due=on_due,
            provision_timeout=provision_timeout,
            max_leases_per_owner=max_leases_per_owner,
            replica_timeout=replica_timeout,
            preemption_grace=preemption_grace,
            notices=notices,
            line_aging=line_aging,
        )
        # Who follows a lease's changes: the parts below tell it of each move they make.
        self.watching = Watching()
        self.ending = Ending(self.core, self.watching)
        self.acquiring = Acquiring(self.core, self.ending)
        # The admission loop's passes (run on one replica by loops/admission.py).
        self.admitting = Admitting(self.core, self.ending)
        self.losing = Losing(self.core, self.watching)
        self.reconciling = Reconciling(self.core, self.ending, self.losing)
        self.pool: Pool | None = None  # WARM_POOL's idle workers (open_pool)
        self.guards: GuardDesk | None = None  # what guards poll (open_guards)

    # What the loops and the operator's views read of it.
    @property
    def store(self) -> LeaseStore:
        return self.core.store

    @property
    def providers(self) -> Sequence[Provider]:
        return self.core.providers

    @property
    def metrics(self) -> Metrics:
        return self.core.metrics

    @property
    def line(self) -> Line:
        return self.core.line

    @property
    def in_flight(self) -> set[str]:
        return self.core.in_flight

    @property
    def clock(self) -> Clock:
        """The one source of time (lifecycle/clock.py): the loops read it too."""
        return self.core.clock

    def now_us(self) -> int:
        return self.core.now_us()

    def capacity_freed(self) -> None:
        self.core.capacity_freed()

    def open_pool(
        self,
        pools: Mapping[Key, PoolEntry],
        handoff: HandOff,
        *,
        max_idle_seconds: float,
        idle_gauge: Gauge,
        scaledown_seconds: float = 300.0,
        max_cost_per_hour: float | None = None,
    ) -> Pool:
        """The warm pools (docs/concepts/pools.md#warm-pools), WARM_POOL's entries, kept
        filled by their loop (loops/warm.py); with none it only recycles what an earlier
        run left."""
        self.pool = Pool(
            self.core,
            self.ending,
            {key: Plan.of(entry, scaledown_seconds) for key, entry in pools.items()},
            handoff,
            max_idle_seconds=max_idle_seconds,
            idle_gauge=idle_gauge,
            max_cost_per_hour=max_cost_per_hour,
        )
        self.acquiring.pool = self.admitting.pool = self.pool
        # An idle worker that dies is replaced at once (the pool loop wakes).
        self.losing.pool_lost = lambda: self.pool.on_taken() if self.pool else None
        return self.pool

    def open_guards(self, *, instance: str, most: int, forget_seconds: float) -> GuardDesk:
        """What the guards poll (docs/concepts/guard.md#the-guard)."""
        self.guards = GuardDesk(
            self.core.store,
            instance=instance,
            providers=[p.name for p in self.core.providers],
            most=most,
            forget_seconds=forget_seconds,
        )
        return self.guards

    async def admit(self) -> int:
        """One pass of the admission loop over the whole line (admitting.py)."""
        return await self.admitting.admit()

    def on_line(self, call: Callable[[], None]) -> None:
        """`call` whenever the line may move (a new caller, a freed room)."""
        self.core.on_line.append(call)

    async def waiting_line(self) -> list[dict[str, Any]]:
        """GET /v1/line: the callers waiting, in admission order (never their env)."""
        now = self.core.now_us()
        return [
            {
                "position": i + 1,
                "owner_id": row.owner_id,
                "correlation_id": row.correlation_id,
                "priority_class": row.priority_class,
                "kind": row.kind,
                "gpu": row.gpu,
                "region": row.region,
                "waited_seconds": round(max(0, now - row.arrived_at) / 1e6, 3),
                "replica": row.replica_id,
            }
            for i, row in enumerate(await self.acquiring.waiting.line_now())
        ]

    def drain(self) -> None:
        """Shutting down (drain.py): every acquire from now on, and each one waiting in
        line, is answered 503 shutting_down; provisions under way finish; every stream of
        a lease's events ends (its client comes back to a replica that is ready)."""
        self.core.line.close()
        self.watching.close()

    # --- what callers ask ------------------------------------------------------------

    async def acquire(
        self, request: LeaseRequest, *, gone: asyncio.Event | None = None
    ) -> LeaseRecord:
        """A lease for `request` (acquiring.py)."""
        return await self.acquiring.acquire(request, gone=gone)

    async def release(self, lease_id: str, owner: str | None) -> None:
        """Release a lease the caller holds (ending.py)."""
        await self.ending.release(lease_id, owner)

    async def renew(self, lease_id: str, owner: str | None, ttl_seconds: int | None) -> LeaseRecord:
        """`expires_at = now + ttl` (default: the lease's own TTL), at most 8 h ahead.
        Only an active, unexpired lease can be renewed: none is ever resurrected."""
        record = await self.get(lease_id)
        now = self.now_us()
        if record.state == LeaseState.preempting:
            check_owner(record, owner)
            raise Preempting(
                f"lease {lease_id} is being preempted: it is not renewed, and its worker "
                f"goes at {record.wire()['preempt_at']}",
                lease_id=lease_id,
                preempt_at=record.wire()["preempt_at"],
            )
        _refuse_lost(record, owner)
        if record.state != LeaseState.active or record.expires_at <= now:
            state = "expired" if record.state == LeaseState.active else record.state
            raise LeaseNotFound(f"lease {lease_id} is {state}; only an active lease renews")
        check_owner(record, owner)
        ttl = min(ttl_seconds or record.ttl_seconds, MAX_TTL_SECONDS)
        expires_at = now + ttl * 1_000_000
        provider = self.core.by_name.get(record.provider)
        if isinstance(provider, BoundedProvider):
            deadline = record.created_at + int(provider.max_lifetime_seconds * 1e6)
            if expires_at > deadline:
                raise PastProviderDeadline(
                    f"lease {lease_id} cannot be renewed past {format_us(deadline)}: "
                    f"{record.provider} ends its worker then, whatever the scheduler does "
                    f"(at most {provider.max_lifetime_seconds:g} s from its creation)",
                    lease_id=lease_id,
                    deadline=format_us(deadline),
                )
        renewed = await self.store.renew(lease_id, states.RENEW, expires_at=expires_at, now=now)
        if renewed is None:
            # Ended meanwhile: its worker's death, heard while this renewal ran, among
            # other ends (a release, the sweeper).
            _refuse_lost(await self.get(lease_id), owner)
            raise LeaseNotFound(f"lease {lease_id} ended while renewing")
        self.watching.changed(lease_id)
        log.info("lease %s renewed until %s", lease_ref(renewed), renewed.wire()["expires_at"])
        if renewed.probe_url and self.pool is not None:  # a warm lease: its worker learns
            await self.pool.hand_on(renewed)
        return renewed

    async def get(self, lease_id: str) -> LeaseRecord:
        record = await self.store.get(lease_id) if is_lease_id(lease_id) else None
        if record is None:
            raise LeaseNotFound(f"no lease {lease_id[:64]!r}")
        return record

    async def search(self, **filters: Any) -> list[dict[str, Any]]:
        """The leases matching `filters` (see LeaseStore.search)."""
        return await self.store.search(**filters)

    async def list_active_json(self) -> bytes:
        """The active leases as a JSON array of `Lease` (cheap for 10,000 leases)."""
        return await self.store.list_json((LeaseState.active, LeaseState.preempting))

    async def usage(self, group_by: GroupBy, *, since: int, until: int) -> counting.Usage:
        """What leases held in [since, until) cost, per group
        (docs/concepts/money.md#usage-and-retention)."""
        return await counting.usage(
            self.store.backend,
            group_by,
            since=since,
            until=until,
            now=self.now_us(),
            pool_owner=POOL_OWNER,
        )

    async def provider_view(self) -> list[dict[str, Any]]:
        """Per provider: health, capacity and use (`GET /v1/providers`)."""
        held = await self.store.count_held()
        idle = [] if self.pool is None else await self.pool.store.counts()
        statuses = await asyncio.gather(*(p.status() for p in self.providers))
        guards = {} if self.guards is None else await self.guards.by_provider()
        now = self.now_us()
        return [
            provider_view(provider, status, held, idle, guards.get(provider.name, []), now)
            for provider, status in zip(self.providers, statuses, strict=True)
        ]

    async def pool_view(self) -> list[dict[str, Any]]:
        """Per warm pool: its target, workers, cost, hits and misses (`GET /v1/pools`)."""
        return [] if self.pool is None else await self.pool.sizing.view()

    # --- what the loops hand over ----------------------------------------------------

    async def recover_after_restart(self) -> None:
        """Before serving (ending.py)."""
        await self.ending.recover_after_restart()

    async def release_due(self, limit: int = 100) -> int:
        """Expired leases and releases to retry (ending.py): how many were claimed."""
        return await self.ending.release_due(limit)

    async def reconcile(
        self,
        provider: Provider,
        workers: Mapping[str, list[WorkerInfo]] | None,
        *,
        listed_at: int,
        alive: set[str] | None,
    ) -> dict[str, int]:
        """What `provider`'s listing of workers (taken at `listed_at`) means for its
        leases (reconciling.py); `alive`: the replicas alive now (None: all count)."""
        return await self.reconciling.settle(provider, workers, listed_at=listed_at, alive=alive)

    async def worker_ended(self, provider: Provider, ended: WorkerEnded) -> bool:
        """A death heard from `provider`'s event stream (losing.py): whether it ended
        a lease (or an idle pool worker)."""
        return await self.losing.heard(provider, ended)

    async def refill_pool(self) -> dict[str, int]:
        """The warm pool's pass (pooling.py); nothing without a pool."""
        return {} if self.pool is None else await self.pool.refill()

    async def purge_ended(self, *, days: int) -> int:
        """Ended leases released more than `days` ago, deleted: how many."""
        return await counting.purge_ended(
            self.store.backend, self.store.states.ended, before=self.now_us() - days * DAY_US
        )

    # --- who follows a lease -----------------------------------------------------------

    async def events(
        self, lease_id: str, owner: str | None, *, quiet: float
    ) -> AsyncIterator[LeaseEvent | None]:
        """The changes of a lease the caller holds, as they happen (watching.py,
        docs/concepts/lease-events.md#the-stream); None after `quiet` seconds without one.
        Checked before it begins (404 unknown, 403 another owner's, 503 draining), so
        that a refusal is an answer of its own, not a broken stream."""
        record = await self.get(lease_id)
        check_owner(record, owner)
        if self.watching.closed:
            raise ShuttingDown()
        return self.watching.follow(record, lambda: self.store.get(lease_id), quiet=quiet)


def _refuse_lost(record: LeaseRecord, owner: str | None) -> None:
    """A renewal of a lease whose worker stopped after its hand-out: 409 `worker_lost`,
    naming why (docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out)."""
    if record.release_reason != ReleaseReason.lost or record.lost_cause is None:
        return
    check_owner(record, owner)
    code = "" if record.exit_code is None else f", exit code {record.exit_code}"
    raise WorkerLost(
        f"lease {record.lease_id} ended: its worker stopped ({record.lost_cause}{code}); "
        "acquire a new lease",
        lease_id=record.lease_id,
        lost_cause=record.lost_cause,
        exit_code=record.exit_code,
    )
