"""Where an acquire gets its worker (acquiring.py, waiting.py): a provider that makes
workers (Cold: its reservation, the worker made outside any transaction, then `active`),
or one whose workers already run (Instant: reserved and active in one transaction). A
reservation made here, outside the line, goes first only while nobody waits
(admission.FirstInLine); a room the admission loop granted is provisioned by `Cold.make`."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import UTC, datetime

from opentelemetry.trace import Status, StatusCode

from openalice_scheduler import timings
from openalice_scheduler.errors import ProviderError, ProviderOutOfCapacity
from openalice_scheduler.lifecycle import admission, states
from openalice_scheduler.lifecycle.admission import reservation_terms
from openalice_scheduler.lifecycle.attempt import Attempt
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.making import destroy_quietly, make_worker
from openalice_scheduler.lifecycle.pooling import Pool
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.providers import InstantProvider, Provider
from openalice_scheduler.store import (
    AtCapacity,
    Behind,
    LeaseRecord,
    OverBudget,
    OverQuota,
    Terms,
)
from openalice_scheduler.tracing import span_attributes

log = logging.getLogger("openalice_scheduler.service")


class Cold:
    """A provider that makes its worker for the lease: reserved (its caps checked), made
    outside any transaction, then recorded `active`."""

    def __init__(self, core: Core, provider: Provider, pool: Pool | None) -> None:
        self.core = core
        self.provider = provider
        self.pool = pool

    async def obtain(self, attempt: Attempt) -> LeaseRecord | None:
        core, provider = self.core, self.provider
        terms = await terms_of(core, provider, attempt)
        if terms is None:
            return None
        try:
            reserved = await self._reserve(attempt, terms)
        except OverQuota:
            raise
        except AtCapacity as exc:
            _at_capacity(attempt, provider, exc)
            return None
        except OverBudget as exc:
            attempt.reasons[provider.name] = exc.message
            attempt.over_budget.append(exc)
            return None
        attempt.written = True
        return await self.make(attempt, reserved)

    async def make(self, attempt: Attempt, reserved: LeaseRecord) -> LeaseRecord | None:
        """The worker of the reserved lease made and ready, the lease `active`; None
        when the provider failed (noted in the attempt)."""
        core, provider = self.core, self.provider
        pool = self.pool
        request = attempt.request
        if not attempt.cold and pool is not None and pool.serves(request, attempt.priority_class):
            pool.missed(request)  # its caller waits a cold start
        attempt.cold = True
        spec = replace(
            attempt.spec,
            lease_id=reserved.lease_id,
            expires_at=datetime.fromtimestamp(reserved.expires_at / 1e6, UTC),
            **core.access.spec_fields(reserved.lease_id),
        )
        # Under an hourly cap, the worker may cost no more than it was checked at.
        budget = attempt.budget
        most = reserved.price_per_hour if budget and budget.per_hour else None
        spec = replace(
            spec, resource=reserved.resource, fence=reserved.fence, max_price_per_hour=most
        )
        attributes = span_attributes(spec.lease_id, provider.name, spec.kind, spec.correlation_id)
        with core.tracer.start_as_current_span("provision", attributes=attributes) as span:
            try:
                with timings.on_worker("cold"):
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

    async def _reserve(self, attempt: Attempt, terms: Terms) -> LeaseRecord:
        """The reservation; at capacity where idle pool workers hold the room, one of
        them is claimed, its room taken over by the reservation, then it is destroyed
        (pools never cost a caller, and no pool pass takes the room in between)."""
        store, name, pool, new = self.core.store, self.provider.name, self.pool, attempt.new
        move = states.MOVE_ON if attempt.written else states.RESERVE
        try:
            return await store.reserve(
                new, admission.reserve(new, name, terms, move, first=self.core.first_in_line())
            )
        except (OverQuota, Behind):
            raise
        except AtCapacity as exc:
            if pool is None:
                raise
            full = exc
        claimed = await pool.give_room(name, new.gpu)
        if claimed is None:
            raise full
        try:
            terms = replace(terms, now=self.core.now_us())
            reserved = await store.reserve(
                new,
                admission.reserve(
                    new, name, terms, move, first=self.core.first_in_line(), freeing=claimed
                ),
            )
        finally:
            problem = await pool.destroy(claimed)
        if problem is not None:
            # Its worker still runs, on the room (and device) the reservation took over:
            # nothing is made on it; the attempt moves on from the reservation, or ends it.
            attempt.written = True
            raise AtCapacity(f"the idle pool worker in the room was not destroyed: {problem}")
        return reserved


class Instant:
    """A provider whose workers already run (static endpoints): nothing to create, the
    lease reserved and active in one transaction."""

    def __init__(self, core: Core, provider: InstantProvider) -> None:
        self.core = core
        self.provider = provider

    async def obtain(self, attempt: Attempt) -> LeaseRecord | None:
        core, provider, spec = self.core, self.provider, attempt.spec
        terms = await terms_of(core, provider, attempt)
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
                        first=core.first_in_line(),
                    ),
                )
                core.metrics.provision_seconds.labels(provider.name).observe(
                    time.perf_counter() - started
                )
        except OverQuota:
            raise
        except AtCapacity as exc:
            _at_capacity(attempt, provider, exc)
            return None
        except OverBudget as exc:
            attempt.reasons[provider.name] = exc.message
            attempt.over_budget.append(exc)
            return None
        return record


def _at_capacity(attempt: Attempt, provider: Provider, exc: AtCapacity) -> None:
    """A provider with no room for the attempt, or whose room the line comes first for
    (Behind: the caller then joins it)."""
    attempt.reasons[provider.name] = exc.message
    attempt.at_capacity = True
    if isinstance(exc, Behind):
        attempt.behind = True


async def terms_of(core: Core, provider: Provider, attempt: Attempt) -> Terms | None:
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
