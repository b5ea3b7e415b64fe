"""The one acquire path: record the lease `provisioning` → get its worker from the first
supply that has one → record it `active`. The supplies are tried in order: the warm pool
(pooling.py), then each provider the policy orders: one that makes workers (Cold: its
reservation, the worker made outside any transaction, then `active`), or one whose
workers already run (Instant: reserved and active in one transaction). A provider that
fails moves the lease to the next; 502 only when all fail."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from datetime import timedelta

from opentelemetry.trace import Status, StatusCode

from openalice_scheduler.errors import (
    BudgetExceeded,
    LineFull,
    NoProviderAvailable,
    ProviderError,
    ProviderOutOfCapacity,
    ProvisionFailed,
    QuotaExceeded,
    no_lease,
)
from openalice_scheduler.ids import new_lease_id
from openalice_scheduler.lifecycle import admission, states
from openalice_scheduler.lifecycle.admission import InLine, reservation_terms
from openalice_scheduler.lifecycle.attempt import Attempt, Supply
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.ending import Ending
from openalice_scheduler.lifecycle.line import Waiter, retry_after
from openalice_scheduler.lifecycle.making import destroy_quietly, make_worker
from openalice_scheduler.lifecycle.pooling import Pool
from openalice_scheduler.lifecycle.preempting import displace
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.models import LeaseRequest, LeaseState
from openalice_scheduler.providers import InstantProvider, Provider, WorkerSpec
from openalice_scheduler.store import (
    AtCapacity,
    Behind,
    DuplicateRequest,
    LeaseRecord,
    NewLease,
    OverBudget,
    OverQuota,
    Terms,
    to_us,
)
from openalice_scheduler.tracing import span_attributes

# The service's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.service")
# How often an idempotent replay looks whether its twin's provision finished.
TWIN_POLL_S = 0.05


class Acquiring:
    def __init__(self, core: Core, ending: Ending) -> None:
        self.core = core
        self.ending = ending
        self.pool: Pool | None = None  # WARM_POOL's idle workers, when opened
        core.line.on_join = self._entered
        core.line.on_leave = self._left

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
        caller = Waiter(
            request.kind.value,
            request.gpu.value,
            priority=cls.value,
            priority_class=cls.name,
            owner=request.owner_id,
            correlation=request.correlation_id,
            region=request.region,
            arrived_at=core.now_us(),
        )
        caller.until = caller.arrived_at + request.wait_seconds * 1_000_000
        try:
            record = await core.line.serve(
                lambda me: self._acquire_once(request, me), request.wait_seconds, gone, caller
            )
        except (NoProviderAvailable, LineFull) as exc:
            raise await self._with_retry_after(exc) from None
        if gone is not None and gone.is_set():
            # Nobody is left to hand the worker to: give it back at once.
            log.info("lease %s: caller left while waiting; releasing", lease_ref(record))
            await self.ending.end(record.lease_id, None)
        return record

    async def _acquire_once(
        self, request: LeaseRequest, caller: Waiter, may_displace: bool = True
    ) -> LeaseRecord:
        core = self.core
        attempt = self._attempt(request, caller)
        lease_id = attempt.new.lease_id
        core.in_flight.add(lease_id)
        try:
            for supply in await self._supplies(attempt):
                try:
                    record = await supply.obtain(attempt)
                except OverQuota as exc:
                    raise self._over_quota(exc) from None
                except DuplicateRequest as exc:
                    # The same request raced us here: its lease is the answer.
                    twin = await self._twin(exc.lease_id)
                    if twin is not None:
                        return twin
                    return await self._acquire_once(request, caller)
                if record is not None:
                    return self._acquired(record)
        finally:
            core.in_flight.discard(lease_id)
        caller.providers = tuple(attempt.eligible)
        if may_displace and attempt.full and await displace(self.core, self.ending, attempt):
            # Room after all (a lease ended meanwhile): tried once more, now.
            return await self._acquire_once(request, caller, may_displace=False)
        if attempt.written:
            # Failed, or out of capacity everywhere it was tried: the row ends failed.
            error = "; ".join((attempt.failures or attempt.reasons).values())
            await core.store.fail(lease_id, states.FAIL, error=error, now=core.now_us())
            core.capacity_freed()
        if attempt.over_budget and not (attempt.failures or attempt.at_capacity):
            raise await self._over_budget(request, attempt)
        raise self._no_lease(request, attempt)

    def _attempt(self, request: LeaseRequest, caller: Waiter) -> Attempt:
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
            priority_class=caller.priority_class,
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
            priority_class=caller.priority_class,
        )
        return Attempt(request, spec, new, core.budgets.of(request.owner_id), caller)

    async def _supplies(self, attempt: Attempt) -> list[Supply]:
        """The warm pool first, when it keeps workers for the request; then each provider,
        in the policy's order."""
        supplies: list[Supply] = []
        if self.pool is not None and self.pool.serves(attempt.request):
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

    def _acquired(self, record: LeaseRecord) -> LeaseRecord:
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

    # --- the line, as the other replicas see it ---------------------------------------

    async def _entered(self, caller: Waiter) -> None:
        await self.core.store.waiters.enter(caller.row())

    async def _left(self, caller: Waiter, outcome: str) -> None:
        await self.core.store.waiters.leave(caller.waiter_id)
        if outcome != "served":
            # It may have held back a caller behind it on another replica.
            await self.core.announce_freed()

    # --- refusals --------------------------------------------------------------------

    async def _over_budget(self, request: LeaseRequest, attempt: Attempt) -> BudgetExceeded:
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

    def _over_quota(self, exc: OverQuota) -> QuotaExceeded:
        self.core.metrics.acquire_failures.labels("quota").inc()
        return QuotaExceeded(exc.message, limit=self.core.max_leases_per_owner)

    async def _with_retry_after(
        self, exc: NoProviderAvailable | LineFull
    ) -> NoProviderAvailable | LineFull:
        """The final 503, with a `Retry-After`: when the next lease is due to end."""
        core = self.core
        reason = "line_full" if isinstance(exc, LineFull) else "no_provider"
        core.metrics.acquire_failures.labels(reason).inc()
        exc.headers["Retry-After"] = str(retry_after(await core.store.next_due(), core.now_us()))
        return exc

    def _no_lease(
        self, request: LeaseRequest, attempt: Attempt
    ) -> ProvisionFailed | NoProviderAvailable:
        what = f"kind={request.kind.value} gpu={request.gpu.value}"
        if request.region:
            what += f" region={request.region}"
        if attempt.failures:
            self.core.metrics.acquire_failures.labels("provision_failed").inc()
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


class Cold:
    """A provider that makes its worker for the lease: reserved (its caps checked), made
    outside any transaction, then recorded `active`."""

    def __init__(self, core: Core, provider: Provider, pool: Pool | None) -> None:
        self.core = core
        self.provider = provider
        self.pool = pool

    async def obtain(self, attempt: Attempt) -> LeaseRecord | None:
        core, provider, spec = self.core, self.provider, attempt.spec
        terms = await _terms(core, provider, attempt)
        if terms is None:
            return None
        try:
            reserved = await self._reserve(attempt.new, terms, attempt.written, attempt.caller)
        except OverQuota:
            raise
        except AtCapacity as exc:
            await _at_capacity(core, attempt, provider, exc, terms)
            return None
        except OverBudget as exc:
            attempt.reasons[provider.name] = exc.message
            attempt.over_budget.append(exc)
            return None
        attempt.written = True
        # Under an hourly cap, the worker may cost no more than it was checked at.
        budget = attempt.budget
        most = reserved.price_per_hour if budget and budget.per_hour else None
        spec = replace(
            spec, resource=reserved.resource, fence=reserved.fence, max_price_per_hour=most
        )
        attributes = span_attributes(spec.lease_id, provider.name, spec.kind, spec.correlation_id)
        with core.tracer.start_as_current_span("provision", attributes=attributes) as span:
            try:
                worker = await make_worker(core, provider, spec)
            except ProviderError as exc:
                span.set_status(Status(StatusCode.ERROR, exc.message))
                log.warning(
                    "lease %s: %s failed to provision: %s",
                    lease_ref(spec),
                    provider.name,
                    exc.message,
                )
                if isinstance(exc, ProviderOutOfCapacity):
                    # No capacity, learnt by trying (RunPod): a reason, as for a provider
                    # unavailable, not a failure; the next provider may serve. One provider
                    # out of capacity and another really failing still answers 502, with
                    # both `reasons` and `failures`.
                    attempt.reasons[provider.name] = exc.message
                else:
                    attempt.failures[provider.name] = exc.message
                return None
        # The TTL counts from the request, time to ready included: the worker was told
        # LEASE_EXPIRES_AT before it started, and lease and worker must agree on it.
        record = await core.store.activate(
            spec.lease_id,
            states.ACTIVATE,
            endpoint=worker.endpoint,
            provider_token=worker.provider_token,
            now=core.now_us(),
            gpu_type=worker.gpu_type,
            price_per_hour=worker.price_per_hour,
            worker_url=worker.probe_url or worker.endpoint,
        )
        if record is None:
            # Reconciliation resolved the lease while we provisioned: do not leak.
            await destroy_quietly(provider, spec.lease_id, worker.provider_token)
            attempt.failures[provider.name] = (
                "the lease was resolved by reconciliation while provisioning"
            )
        return record

    async def _reserve(
        self, new: NewLease, terms: Terms, moving: bool, caller: Waiter
    ) -> LeaseRecord:
        """The reservation; at capacity where idle pool workers hold the room, one of
        them is destroyed and the reservation tried once more (pools never cost a caller)."""
        store, name = self.core.store, self.provider.name
        move = states.MOVE_ON if moving else states.RESERVE
        try:
            return await store.reserve(
                new, admission.reserve(new, name, terms, move, line=self._line(caller))
            )
        except (OverQuota, Behind):
            raise
        except AtCapacity:
            if self.pool is None or not await self.pool.make_room(name, new.gpu):
                raise
        terms = replace(terms, now=self.core.now_us())
        return await store.reserve(
            new, admission.reserve(new, name, terms, move, line=self._line(caller))
        )

    def _line(self, caller: Waiter) -> tuple[Provider, InLine]:
        return self.provider, self.core.in_line(caller)


class Instant:
    """A provider whose workers already run (static endpoints): nothing to create, the
    lease reserved and active in one transaction."""

    def __init__(self, core: Core, provider: InstantProvider) -> None:
        self.core = core
        self.provider = provider

    async def obtain(self, attempt: Attempt) -> LeaseRecord | None:
        core, provider, spec = self.core, self.provider, attempt.spec
        terms = await _terms(core, provider, attempt)
        if terms is None:
            return None
        attributes = span_attributes(spec.lease_id, provider.name, spec.kind, spec.correlation_id)
        try:
            with core.tracer.start_as_current_span("provision", attributes=attributes):
                started = time.perf_counter()
                move = states.ASSIGN_MOVED if attempt.written else states.ASSIGN
                record = await core.store.reserve(
                    attempt.new,
                    admission.reserve(
                        attempt.new,
                        provider.name,
                        terms,
                        move,
                        provider.assign,
                        line=(provider, core.in_line(attempt.caller)),
                    ),
                )
                core.metrics.provision_seconds.labels(provider.name).observe(
                    time.perf_counter() - started
                )
        except OverQuota:
            raise
        except AtCapacity as exc:
            await _at_capacity(core, attempt, provider, exc, terms)
            return None
        except OverBudget as exc:
            attempt.reasons[provider.name] = exc.message
            attempt.over_budget.append(exc)
            return None
        return record


async def _at_capacity(
    core: Core,
    attempt: Attempt,
    provider: Provider,
    exc: AtCapacity,
    terms: Terms | None = None,
) -> None:
    """A provider with no room for the attempt, or whose room a caller ahead in line
    waits for (Behind): that caller is woken, wherever it waits."""
    attempt.reasons[provider.name] = exc.message
    attempt.at_capacity = True
    if isinstance(exc, Behind):
        await core.announce_freed()
    elif terms is not None:
        attempt.full.append((provider, terms))


async def _terms(core: Core, provider: Provider, attempt: Attempt) -> Terms | None:
    """What a reservation on `provider` must respect; None (the reason noted) when the
    provider cannot serve the request at all right now."""
    availability = await provider.available(attempt.spec)
    if not availability.ok:
        attempt.reasons[provider.name] = availability.reason
        return None
    attempt.eligible.append(provider.name)
    return reservation_terms(
        provider,
        attempt.spec,
        now=core.now_us(),
        owner_quota=core.max_leases_per_owner,
        price=await provider.price(attempt.spec),
        budget=attempt.budget,
    )
