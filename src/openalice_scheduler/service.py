"""LeaseService: the lifecycle rules of the contract live here and only here.

acquire: record `provisioning` → pick a provider → provision (outside any transaction)
→ record `active`. release: claim `releasing` → destroy → record `released`, or keep
`releasing` with a retry time when the provider could not confirm. The loops (loops.py)
find what is due or adrift and hand each case to a method here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Status, StatusCode, Tracer

from openalice_scheduler.budgets import Budgets
from openalice_scheduler.capacity import provider_view
from openalice_scheduler.errors import (
    BudgetExceeded,
    LeaseNotFound,
    NoProviderAvailable,
    ProviderError,
    ProviderOutOfCapacity,
    ProvisionFailed,
    QuotaExceeded,
    no_lease,
)
from openalice_scheduler.ids import is_lease_id, new_lease_id
from openalice_scheduler.lease_access import LeaseAccess
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.models import MAX_TTL_SECONDS, LeaseRequest, LeaseState
from openalice_scheduler.policy import Policy
from openalice_scheduler.providers import InstantProvider, Provider, WorkerSpec, reservation_terms
from openalice_scheduler.providers.probe import ReadyProbe
from openalice_scheduler.releasing import Releasing, check_owner
from openalice_scheduler.store import (
    AtCapacity,
    DuplicateRequest,
    LeaseRecord,
    LeaseStore,
    NewLease,
    OverBudget,
    OverQuota,
    Terms,
    to_us,
)
from openalice_scheduler.tracing import span_attributes

if TYPE_CHECKING:
    from openalice_scheduler.guards import GuardDesk
    from openalice_scheduler.pool import WarmPool
from openalice_scheduler.waiting import CapacityQueue, retry_after

log = logging.getLogger(__name__)

Clock = Callable[[], datetime]
MAX_PARALLEL_RELEASES = 16  # worker destructions the sweeper runs at once
# How often an idempotent replay looks whether its twin's provision finished.
TWIN_POLL_S = 0.05


def utcnow() -> datetime:
    return datetime.now(UTC)


class LeaseService(Releasing):
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
        clock: Clock = utcnow,
        on_due: Callable[[int], None] = lambda _at: None,
        access: LeaseAccess | None = None,
        budgets: Budgets | None = None,
    ) -> None:
        self.store = store
        self.providers = list(providers)
        self.by_name = {p.name: p for p in self.providers}
        # Providers whose workers already exist: nothing to create or destroy.
        self.instant = tuple(p.name for p in self.providers if isinstance(p, InstantProvider))
        self.policy = policy
        self.metrics = metrics
        self.tracer = tracer
        self.provision_timeout = provision_timeout
        self.probe = probe or ReadyProbe({}, {})  # none given: workers are not probed
        self.max_leases_per_owner = max_leases_per_owner
        self.clock = clock
        # Called with the moment (µs) something new becomes due (the sweeper's alarm).
        self.on_due = on_due
        # A worker's credential for its own lease (none: workers are not told one).
        self.access = access or LeaseAccess("", None)
        # Each owner's caps in money (none given: no caps).
        self.budgets = budgets or Budgets()
        self.queue = CapacityQueue(metrics)
        # Leases this process is provisioning right now: the reconciler leaves them be.
        self.in_flight: set[str] = set()
        self._releases = asyncio.Semaphore(MAX_PARALLEL_RELEASES)
        self.pool: WarmPool | None = None  # WARM_POOL's idle workers (lifespan sets it)
        self.guards: GuardDesk | None = None  # what guards poll (lifespan sets it)

    def now_us(self) -> int:
        return to_us(self.clock())

    def drain(self) -> None:
        """Shutting down (drain.py): every acquire from now on, and each one waiting in
        line, is answered 503 shutting_down; provisions under way finish."""
        self.queue.close()

    # --- acquire ---------------------------------------------------------------------

    async def acquire(
        self, request: LeaseRequest, *, gone: asyncio.Event | None = None
    ) -> LeaseRecord:
        """A lease for `request`. The same (owner_id, correlation_id) while its lease is
        provisioning or active gets that lease back, never a second worker. With
        `wait_seconds`, waits in line for capacity; `gone` is set when the caller left."""
        twin = await self._replay(request)
        if twin is not None:
            return twin
        try:
            record = await self.queue.serve(
                lambda: self._acquire_once(request),
                request.wait_seconds,
                gone,
                kind=request.kind.value,
                gpu=request.gpu.value,
            )
        except NoProviderAvailable as exc:
            raise await self._with_retry_after(exc) from None
        if gone is not None and gone.is_set():
            # Nobody is left to hand the worker to: give it back at once.
            log.info("lease %s: caller left while waiting; releasing", lease_ref(record))
            await self._release(record.lease_id, None)
        return record

    async def _acquire_once(self, request: LeaseRequest) -> LeaseRecord:
        lease_id = new_lease_id()
        now = self.clock()
        spec = WorkerSpec(
            lease_id=lease_id,
            kind=request.kind,
            gpu=request.gpu,
            expires_at=now + timedelta(seconds=request.ttl_seconds),
            owner_id=request.owner_id,
            correlation_id=request.correlation_id,
            region=request.region,
            store_id=self.store.store_id,
            env=request.env,
        )
        spec = replace(spec, **self.access.spec_fields(lease_id))
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
        )
        reasons: dict[str, str] = {}
        failures: dict[str, str] = {}
        over_budget: list[OverBudget] = []
        at_capacity = False
        written = False  # this lease's row exists (a provider was tried)
        budget = self.budgets.of(request.owner_id)
        self.in_flight.add(lease_id)
        try:
            warm = await self._take_warm(request, over_budget)
            if warm is not None:
                return self._acquired(warm.provider, warm)
            order = await self.policy.order(self.providers, spec)
            log.debug(
                "lease %s (%s, gpu=%s, correlation_id=%s): trying %s",
                lease_ref(spec),
                spec.kind,
                spec.gpu,
                spec.correlation_id,
                ", ".join(p.name for p in order),
            )
            for provider in order:
                availability = await provider.available(spec)
                if not availability.ok:
                    reasons[provider.name] = availability.reason
                    continue
                terms = reservation_terms(
                    provider,
                    spec,
                    now=self.now_us(),
                    owner_quota=self.max_leases_per_owner,
                    price=await provider.price(spec),
                    budget=budget,
                )
                try:
                    if isinstance(provider, InstantProvider):
                        # Nothing to create: reserved and active in one transaction.
                        return await self._assign(provider, new, spec, terms, written)
                    reserved = await self._reserve(provider.name, new, terms, written)
                except OverQuota as exc:
                    raise self._over_quota(exc) from None
                except DuplicateRequest as exc:
                    # The same request raced us here: its lease is the answer.
                    twin = await self._twin(exc.lease_id)
                    return twin if twin is not None else await self._acquire_once(request)
                except AtCapacity as exc:
                    reasons[provider.name] = exc.message
                    at_capacity = True
                    continue
                except OverBudget as exc:
                    reasons[provider.name] = exc.message
                    over_budget.append(exc)
                    continue
                written = True
                # Under an hourly cap, the worker may cost no more than it was checked at.
                most = reserved.price_per_hour if budget and budget.per_hour else None
                try:
                    record = await self._provision(
                        provider,
                        replace(
                            spec,
                            resource=reserved.resource,
                            fence=reserved.fence,
                            max_price_per_hour=most,
                        ),
                    )
                except ProviderOutOfCapacity as exc:
                    # No capacity, learnt by trying (RunPod): a reason, as for a provider
                    # unavailable, not a failure; the next provider may serve. One provider
                    # out of capacity and another really failing still answers 502, with
                    # both `reasons` and `failures`.
                    reasons[provider.name] = exc.message
                    continue
                if isinstance(record, LeaseRecord):
                    return record
                failures[provider.name] = record
        finally:
            self.in_flight.discard(lease_id)
        if written:
            # Failed, or out of capacity everywhere it was tried: the row ends failed.
            error = "; ".join((failures or reasons).values())
            await self.store.fail(lease_id, error=error, now=self.now_us())
            self.capacity_freed()
        if over_budget and not (failures or at_capacity):
            raise await self._over_budget(request, over_budget, reasons)
        raise self._no_lease(request, reasons, failures, at_capacity)

    async def _take_warm(
        self, request: LeaseRequest, over_budget: list[OverBudget]
    ) -> LeaseRecord | None:
        """A ready worker of the pool, when it has one for `request` (else None: cold).
        The quota, the owner's caps and a twin request are checked as for a cold
        reserve; a pool worker over the owner's budget is noted in `over_budget` (a
        cheaper provider may serve cold)."""
        if self.pool is None:
            return None
        try:
            return await self.pool.take(request)
        except OverQuota as exc:
            raise self._over_quota(exc) from None
        except OverBudget as exc:
            over_budget.append(exc)
            return None
        except DuplicateRequest as exc:
            return await self._twin(exc.lease_id)  # None: it failed, this one goes cold

    async def _over_budget(
        self, request: LeaseRequest, refusals: list[OverBudget], reasons: dict[str, str]
    ) -> BudgetExceeded:
        """The 429 when every provider left would break the owner's caps: the refusal
        at the cheapest price, with the owner's figures as the store has them now."""
        self.metrics.acquire_failures.labels("budget").inc()
        cheapest = min(refusals, key=lambda r: r.price)
        assert request.owner_id is not None, "only owners have caps"
        per_hour, spent = await self.store.owner_money(request.owner_id, now=self.now_us())
        return BudgetExceeded(
            f"{cheapest.message} (cheapest price refused: {cheapest.price:.4g} $/h)",
            owner_id=request.owner_id,
            cap=cheapest.cap,
            limit=cheapest.limit,
            owner_cost_per_hour=round(per_hour, 6),
            owner_spend_24h=round(spent, 6),
            cheapest_refused_price=cheapest.price,
            reasons=reasons,
        )

    def _over_quota(self, exc: OverQuota) -> QuotaExceeded:
        self.metrics.acquire_failures.labels("quota").inc()
        return QuotaExceeded(exc.message, limit=self.max_leases_per_owner)

    async def _reserve(
        self, provider: str, new: NewLease, terms: Terms, moving: bool
    ) -> LeaseRecord:
        """store.reserve_lease; at capacity where idle pool workers hold the room, one of
        them is destroyed and the reservation tried once more (pools never cost a caller)."""
        try:
            return await self.store.reserve_lease(new, provider, terms, moving=moving)
        except OverQuota:
            raise
        except AtCapacity:
            if self.pool is None or not await self.pool.make_room(provider, new.gpu):
                raise
        return await self.store.reserve_lease(
            new, provider, replace(terms, now=self.now_us()), moving=moving
        )

    async def _replay(self, request: LeaseRequest) -> LeaseRecord | None:
        existing = await self.store.find_request(request.owner_id, request.correlation_id)
        return None if existing is None else await self._twin(existing.lease_id)

    async def _twin(self, lease_id: str) -> LeaseRecord | None:
        """The lease another acquire of the same request is making, once active; None
        when that acquire failed (this one then tries on its own)."""
        deadline = time.monotonic() + self.provision_timeout + self.probe.longest + 5
        while time.monotonic() < deadline:
            record = await self.store.get(lease_id)
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

    async def _with_retry_after(self, exc: NoProviderAvailable) -> NoProviderAvailable:
        """The final 503, with a `Retry-After`: when the next lease is due to end."""
        self.metrics.acquire_failures.labels("no_provider").inc()
        exc.headers["Retry-After"] = str(retry_after(await self.store.next_due(), self.now_us()))
        return exc

    async def _provision(self, provider: Provider, spec: WorkerSpec) -> LeaseRecord | str:
        """The lease on `provider`, or why it failed (after cleaning up). Out of capacity
        (ProviderOutOfCapacity) is raised, after cleaning up too: it is no failure."""
        attributes = span_attributes(spec.lease_id, provider.name, spec.kind, spec.correlation_id)
        with self.tracer.start_as_current_span("provision", attributes=attributes) as span:
            started = time.perf_counter()
            try:
                worker = await asyncio.wait_for(
                    provider.provision(spec), timeout=self.provision_timeout
                )
                self.metrics.provision_seconds.labels(provider.name).observe(
                    time.perf_counter() - started
                )
                # Still `provisioning` while probed: a crash now is resolved as any other.
                await self.probe.wait(provider.name, spec, worker, since=started)
            except (ProviderError, TimeoutError) as exc:
                message = (
                    exc.message
                    if isinstance(exc, ProviderError)
                    else f"no worker after {self.provision_timeout:g} s"
                )
                span.set_status(Status(StatusCode.ERROR, message))
                log.warning(
                    "lease %s: %s failed to provision: %s", lease_ref(spec), provider.name, message
                )
                await self._clean_half_made(provider, spec.lease_id)  # a worker not ready too
                if isinstance(exc, ProviderOutOfCapacity):
                    raise
                return message
        # The TTL counts from the request, time to ready included: the worker was told
        # LEASE_EXPIRES_AT before it started, and lease and worker must agree on it.
        record = await self.store.activate(
            spec.lease_id,
            endpoint=worker.endpoint,
            provider_token=worker.provider_token,
            now=self.now_us(),
            gpu_type=worker.gpu_type,
            price_per_hour=worker.price_per_hour,
        )
        if record is None:
            # Reconciliation resolved the lease while we provisioned: do not leak.
            await self._clean_half_made(provider, spec.lease_id, worker.provider_token)
            return "the lease was resolved by reconciliation while provisioning"
        return self._acquired(provider.name, record)

    async def _assign(
        self, provider: InstantProvider, new: NewLease, spec: WorkerSpec, terms: Terms, moving: bool
    ) -> LeaseRecord:
        attributes = span_attributes(spec.lease_id, provider.name, spec.kind, spec.correlation_id)
        with self.tracer.start_as_current_span("provision", attributes=attributes):
            started = time.perf_counter()
            record = await self.store.reserve_active(
                new, provider.name, terms, provider.assign, moving=moving
            )
            self.metrics.provision_seconds.labels(provider.name).observe(
                time.perf_counter() - started
            )
        return self._acquired(provider.name, record)

    def _acquired(self, provider: str, record: LeaseRecord) -> LeaseRecord:
        self.metrics.acquired.labels(provider, record.kind, record.gpu).inc()
        self.on_due(record.expires_at)
        log.info(
            "lease %s acquired on %s (%s, gpu=%s, correlation_id=%s)",
            lease_ref(record),
            provider,
            record.kind,
            record.gpu,
            record.correlation_id,
        )
        return record

    async def _clean_half_made(self, provider: Provider, lease_id: str, token: str = "") -> None:
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

    def _no_lease(
        self,
        request: LeaseRequest,
        reasons: dict[str, str],
        failures: dict[str, str],
        at_capacity: bool,
    ) -> ProvisionFailed | NoProviderAvailable:
        what = f"kind={request.kind.value} gpu={request.gpu.value}"
        if request.region:
            what += f" region={request.region}"
        if failures:
            self.metrics.acquire_failures.labels("provision_failed").inc()
        return no_lease(what, reasons, failures, at_capacity)

    # --- renew -----------------------------------------------------------------------

    async def renew(self, lease_id: str, owner: str | None, ttl_seconds: int | None) -> LeaseRecord:
        """`expires_at = now + ttl` (default: the lease's own TTL), at most 8 h ahead.
        Only an active, unexpired lease can be renewed: none is ever resurrected."""
        record = await self.get(lease_id)
        now = self.now_us()
        if record.state != LeaseState.active or record.expires_at <= now:
            state = "expired" if record.state == LeaseState.active else record.state
            raise LeaseNotFound(f"lease {lease_id} is {state}; only an active lease renews")
        check_owner(record, owner)
        ttl = min(ttl_seconds or record.ttl_seconds, MAX_TTL_SECONDS)
        renewed = await self.store.renew(lease_id, expires_at=now + ttl * 1_000_000, now=now)
        if renewed is None:
            raise LeaseNotFound(f"lease {lease_id} ended while renewing")
        log.info("lease %s renewed until %s", lease_ref(renewed), renewed.wire()["expires_at"])
        if renewed.probe_url and self.pool is not None:  # a warm lease: its worker learns
            await self.pool.hand_on(renewed)
        return renewed

    # --- reads -----------------------------------------------------------------------

    async def get(self, lease_id: str) -> LeaseRecord:
        record = await self.store.get(lease_id) if is_lease_id(lease_id) else None
        if record is None:
            raise LeaseNotFound(f"no lease {lease_id[:64]!r}")
        return record

    async def search(self, **filters: Any) -> list[dict[str, Any]]:
        """The leases matching `filters` (see LeaseStore.search)."""
        return await self.store.search(**filters)

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

    async def list_active_json(self) -> bytes:
        """The active leases as a JSON array of `Lease` (cheap for 10,000 leases)."""
        return await self.store.list_json((LeaseState.active,))
