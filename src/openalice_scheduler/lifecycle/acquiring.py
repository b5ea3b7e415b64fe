"""The one acquire path: record the lease `provisioning` → get its worker from the first
supply that has one → record it `active`. While nobody waits in line, an acquire takes a
room directly (the fast path): the warm pool first (pooling.py), then each provider the
policy orders (supplies.py). A provider that fails moves the lease to the next; 502
only when all fail. A caller that finds no room, or finds callers waiting, joins the
line (waiting.py), where the admission loop (admitting.py) decides."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from datetime import timedelta

from openalice_scheduler.errors import (
    BudgetExceeded,
    LineFull,
    NoProviderAvailable,
    ProvisionFailed,
    QuotaExceeded,
    ShuttingDown,
    no_lease,
)
from openalice_scheduler.ids import new_lease_id
from openalice_scheduler.lifecycle import states
from openalice_scheduler.lifecycle.attempt import Attempt, Supply
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.ending import Ending
from openalice_scheduler.lifecycle.pooling import Pool
from openalice_scheduler.lifecycle.supplies import Cold, Instant
from openalice_scheduler.lifecycle.waiting import Waiting
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.models import LeaseRequest, LeaseState
from openalice_scheduler.providers import InstantProvider, WorkerSpec
from openalice_scheduler.store import DuplicateRequest, LeaseRecord, NewLease, OverQuota, to_us

# The service's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.service")
# How often an idempotent replay looks whether its twin's provision finished.
TWIN_POLL_S = 0.05


class Acquiring:
    def __init__(self, core: Core, ending: Ending) -> None:
        self.core = core
        self.ending = ending
        self.pool: Pool | None = None  # WARM_POOL's idle workers, when opened
        self.waiting = Waiting(core, self)

    async def acquire(
        self, request: LeaseRequest, *, gone: asyncio.Event | None = None
    ) -> LeaseRecord:
        """A lease for `request`. The same (owner_id, correlation_id) while its lease is
        provisioning or active gets that lease back, never a second worker. With
        `wait_seconds`, waits in line for capacity; `gone` is set when the caller left."""
        core = self.core
        cls = core.priorities.of(request.priority_class, request.owner_id)
        twin = await self._replay(request)
        if twin is not None:
            return twin
        if core.line.closed:
            raise ShuttingDown()
        attempt = self.attempt(request, cls.name)
        try:
            record = await self._direct(attempt)
            if record is None:
                record = await self.waiting.wait(request, attempt, cls.name, gone)
        except (NoProviderAvailable, LineFull) as exc:
            raise await self.waiting.with_retry_after(exc) from None
        if gone is not None and gone.is_set():
            # Nobody is left to hand the worker to: give it back at once.
            log.info("lease %s: caller left while waiting; releasing", lease_ref(record))
            await self.ending.end(record.lease_id, None)
        return record

    async def _direct(self, attempt: Attempt) -> LeaseRecord | None:
        """The lease from the first supply with room, while nobody waits in line; None
        when the caller must join the line (no room, and it waits or callers already
        do). Raises the refusals that waiting cannot change (quota, caps in money, every
        provider failed)."""
        core, request = self.core, attempt.request
        lease_id = attempt.new.lease_id
        core.in_flight.add(lease_id)
        try:
            for supply in await self._supplies(attempt):
                try:
                    record = await supply.obtain(attempt)
                except OverQuota as exc:
                    raise self.over_quota(exc) from None
                except DuplicateRequest as exc:
                    # The same request raced us here: its lease is the answer.
                    twin = await self._twin(exc.lease_id)
                    if twin is not None:
                        return twin
                    return await self._direct(self.attempt(request, attempt.priority_class))
                if record is not None:
                    return self.acquired(record)
        finally:
            core.in_flight.discard(lease_id)
        if attempt.written:
            # Failed, or out of capacity everywhere it was tried: the row ends failed.
            error = "; ".join((attempt.failures or attempt.reasons).values())
            await core.store.fail(lease_id, states.FAIL, error=error, now=core.now_us())
            core.capacity_freed()
        if attempt.behind:
            return None  # the line is served first: this caller joins it
        if attempt.over_budget and not (attempt.failures or attempt.at_capacity):
            raise await self.over_budget(request, attempt)
        if attempt.at_capacity and request.wait_seconds > 0:
            return None
        raise self.no_lease(request, attempt)

    def attempt(self, request: LeaseRequest, priority_class: str) -> Attempt:
        core = self.core
        lease_id = new_lease_id()
        now = core.clock.now()
        spec = WorkerSpec(
            lease_id=lease_id,
            kind=request.kind,
            gpu=request.gpu,
            expires_at=now + timedelta(seconds=request.ttl_seconds),
            owner_id=request.owner_id,
            correlation_id=request.correlation_id,
            region=request.region,
            store_id=core.store.store_id,
            env=request.env,
            priority_class=priority_class,
        )
        spec = replace(spec, **core.access.spec_fields(lease_id))
        new = NewLease(
            lease_id=lease_id,
            kind=request.kind.value,
            gpu=request.gpu.value,
            owner_id=request.owner_id,
            correlation_id=request.correlation_id,
            region=request.region,
            ttl_seconds=request.ttl_seconds,
            created_at=to_us(now),
            expires_at=to_us(spec.expires_at),
            priority_class=priority_class,
            requested_at=to_us(now),
        )
        return Attempt(request, spec, new, core.budgets.of(request.owner_id), priority_class)

    async def _supplies(self, attempt: Attempt) -> list[Supply]:
        """The warm pool first, when it keeps workers for the request; then each provider,
        in the policy's order."""
        supplies: list[Supply] = []
        if self.pool is not None and self.pool.serves(attempt.request, attempt.priority_class):
            supplies.append(self.pool)
        spec = attempt.spec
        order = await self.core.policy.order(self.core.providers, spec)
        log.debug(
            "lease %s (%s, gpu=%s, correlation_id=%s): trying %s",
            lease_ref(spec),
            spec.kind,
            spec.gpu,
            spec.correlation_id,
            ", ".join(p.name for p in order),
        )
        for provider in order:
            if isinstance(provider, InstantProvider):
                supplies.append(Instant(self.core, provider))
            else:
                supplies.append(Cold(self.core, provider, self.pool))
        return supplies

    def acquired(self, record: LeaseRecord) -> LeaseRecord:
        self.core.metrics.acquired.labels(record.provider, record.kind, record.gpu).inc()
        self.core.on_due(record.expires_at)
        log.info(
            "lease %s acquired on %s (%s, gpu=%s, correlation_id=%s)",
            lease_ref(record),
            record.provider,
            record.kind,
            record.gpu,
            record.correlation_id,
        )
        return record

    # --- refusals --------------------------------------------------------------------

    async def over_budget(self, request: LeaseRequest, attempt: Attempt) -> BudgetExceeded:
        """The 429 when every provider left would break the owner's caps: the refusal
        at the cheapest price, with the owner's figures as the store has them now."""
        core = self.core
        core.metrics.acquire_failures.labels("budget").inc()
        cheapest = min(attempt.over_budget, key=lambda r: r.price)
        assert request.owner_id is not None, "only owners have caps"
        per_hour, spent = await core.store.owner_money(request.owner_id, now=core.now_us())
        return BudgetExceeded(
            f"{cheapest.message} (cheapest price refused: {cheapest.price:.4g} $/h)",
            owner_id=request.owner_id,
            cap=cheapest.cap,
            limit=cheapest.limit,
            owner_cost_per_hour=round(per_hour, 6),
            owner_spend_24h=round(spent, 6),
            cheapest_refused_price=cheapest.price,
            reasons=attempt.reasons,
        )

    def over_quota(self, exc: OverQuota) -> QuotaExceeded:
        self.core.metrics.acquire_failures.labels("quota").inc()
        return QuotaExceeded(exc.message, limit=self.core.max_leases_per_owner)

    def no_lease(
        self, request: LeaseRequest, attempt: Attempt
    ) -> ProvisionFailed | NoProviderAvailable:
        what = f"kind={request.kind.value} gpu={request.gpu.value}"
        if request.region:
            what += f" region={request.region}"
        if attempt.failures:
            self.core.metrics.acquire_failures.labels("provision_failed").inc()
        elif attempt.at_capacity:
            self.core.metrics.refused_at_capacity(request.kind.value, request.gpu.value)
        return no_lease(what, attempt.reasons, attempt.failures, attempt.at_capacity)

    # --- the same request again ------------------------------------------------------

    async def _replay(self, request: LeaseRequest) -> LeaseRecord | None:
        existing = await self.core.store.find_request(request.owner_id, request.correlation_id)
        return None if existing is None else await self._twin(existing.lease_id)

    async def _twin(self, lease_id: str) -> LeaseRecord | None:
        """The lease another acquire of the same request is making, once active; None
        when that acquire failed (this one then tries on its own)."""
        core = self.core
        deadline = core.clock.monotonic() + core.provision_timeout + core.probe.longest + 5
        while core.clock.monotonic() < deadline:
            record = await core.store.get(lease_id)
            if record is None or record.state not in (LeaseState.provisioning, LeaseState.active):
                return None
            if record.state == LeaseState.active:
                log.info(
                    "lease %s returned again for correlation_id=%s",
                    lease_ref(record),
                    record.correlation_id,
                )
                return record
            await asyncio.sleep(TWIN_POLL_S)
        return None
