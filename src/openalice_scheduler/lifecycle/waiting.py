"""A caller in line (docs/concepts/priorities.md#the-admission-loop): it joins (its row in
the store, a `Waiter` here), sleeps until the admission loop decides on it, and then
finishes what the loop granted on this replica, where its request (and its `env`, never
stored) is: an idle pool worker handed off, a cold worker made, a static endpoint
already active. A provider that fails the provision is left out and the caller waits on
in its place for the others; a refusal is answered as the fast path would (429 over a
cap, 503 without room for a caller that does not wait).

Its wait ends at `wait_seconds` (503, with the position it had), when its caller hangs
up, or when the line is closed (drain). Leaving takes its row back by a guarded delete:
a room granted at that very moment is still the caller's (or released at once if the
caller is gone), never lost."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Protocol

from openalice_scheduler.errors import (
    BudgetExceeded,
    LineFull,
    NoProviderAvailable,
    ProvisionFailed,
    QuotaExceeded,
    ShuttingDown,
)
from openalice_scheduler.ids import new_lease_id
from openalice_scheduler.lifecycle import states
from openalice_scheduler.lifecycle.attempt import Attempt
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.line import Waiter, new_waiter_id, order, retry_after
from openalice_scheduler.lifecycle.pooling import Pool
from openalice_scheduler.lifecycle.supplies import Cold
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.models import LeaseRequest, LeaseState
from openalice_scheduler.store import LeaseRecord, OverBudget, OverQuota
from openalice_scheduler.store.waiters import KEEP_ARRIVAL_US, Decision, WaitingRow

log = logging.getLogger("openalice_scheduler.waiting")
# A caller that does not wait still joins the line when others wait, for one decision:
# it is answered within this long even when no admission loop runs.
VERDICT_S = 5.0


class Acquirer(Protocol):
    """What the acquire path (acquiring.py) lends the line."""

    pool: Pool | None

    def attempt(self, request: LeaseRequest, priority_class: str) -> Attempt: ...
    def acquired(self, record: LeaseRecord) -> LeaseRecord: ...
    async def over_budget(self, request: LeaseRequest, attempt: Attempt) -> BudgetExceeded: ...
    def no_lease(
        self, request: LeaseRequest, attempt: Attempt
    ) -> ProvisionFailed | NoProviderAvailable: ...
    def over_quota(self, exc: OverQuota) -> QuotaExceeded: ...


class Waiting:
    def __init__(self, core: Core, acquirer: Acquirer) -> None:
        self.core = core
        self.acquirer = acquirer
        self._collecting = False
        self._again = False
        core.on_line.append(self.collect_soon)

    async def wait(
        self,
        request: LeaseRequest,
        attempt: Attempt,
        priority_class: str,
        gone: asyncio.Event | None,
    ) -> LeaseRecord:
        core = self.core
        line = core.line
        if line.closed:
            raise ShuttingDown()
        providers = tuple(p for p in attempt.eligible if p not in attempt.failures)
        if not providers:
            raise self.acquirer.no_lease(request, attempt)
        cls = core.priorities.classes[priority_class]
        patient = request.wait_seconds > 0
        span = request.wait_seconds if patient else VERDICT_S
        now = core.now_us()
        pool = self.acquirer.pool
        row = WaitingRow(
            waiter_id=new_waiter_id(),
            priority=cls.value,
            arrived_at=now,
            kind=request.kind.value,
            gpu=request.gpu.value,
            region=request.region,
            owner_id=request.owner_id,
            correlation_id=request.correlation_id,
            priority_class=priority_class,
            providers=providers,
            until=now + int(span * 1e6),
            lease_id=new_lease_id(),
            ttl_seconds=request.ttl_seconds,
            patient=patient,
            pooled=pool is not None and pool.serves(request, priority_class),
        )
        await self._make_room(row)
        waiter = Waiter(row)
        line.add(waiter)
        core.in_flight.add(row.lease_id)
        outcome = "refused"
        try:
            await core.store.waiters.enter(row)
            log.info(
                "acquire (%s, gpu=%s, class %s) waits up to %.0f s in line",
                row.kind,
                row.gpu,
                priority_class,
                span,
            )
            await core.announce_freed()  # the admission loop looks at once
            deadline = line.clock.monotonic() + span
            while True:
                await line.wait(waiter, deadline - line.clock.monotonic(), gone)
                if waiter.pushed_out is not None:
                    raise waiter.pushed_out
                left = line.closed or (gone is not None and gone.is_set())
                late = line.clock.monotonic() >= deadline
                decision = waiter.decision
                if decision is None and not (left or late):
                    continue
                if decision is None:
                    # Where it stood as its wait ran out (its row is out of line after).
                    position = (
                        await self.position(row.waiter_id, at=row.until - 1) if late else None
                    )
                    keep = core.now_us() + KEEP_ARRIVAL_US if late and not left else None
                    decision = await core.store.waiters.take_back(row.waiter_id, keep_until=keep)
                    if decision is None:
                        outcome = "gone" if gone is not None and gone.is_set() else "timeout"
                        if line.closed:
                            raise ShuttingDown()
                        raise self._waited_out(request, attempt, span, position)
                record = await self._decided(request, attempt, waiter, decision)
                if record is not None:
                    outcome = "served"
                    return record
                waiter.decision = None
                waiter.decided.clear()
        finally:
            line.remove(waiter, outcome)
            core.in_flight.discard(waiter.row.lease_id)

    async def _decided(
        self, request: LeaseRequest, attempt: Attempt, waiter: Waiter, decision: Decision
    ) -> LeaseRecord | None:
        """The lease the loop granted, made ready here; None when its provider failed
        and the caller waits on for the others (its row re-armed). Raises a refusal."""
        core = self.core
        if decision.refusal is not None:
            await core.store.waiters.take_back(waiter.waiter_id)
            raise await self._refused(request, attempt, json.loads(decision.refusal))
        assert decision.granted is not None
        core.in_flight.add(decision.granted)
        try:
            record = await self._finish(request, attempt, decision.granted)
        finally:
            core.in_flight.discard(decision.granted)
        if record is not None:
            await core.store.waiters.take_back(waiter.waiter_id)
            return self.acquirer.acquired(record)
        row = waiter.row
        providers = tuple(p for p in row.providers if p not in attempt.failures)
        if not providers:
            await core.store.waiters.take_back(waiter.waiter_id)
            raise self.acquirer.no_lease(request, attempt)
        core.in_flight.discard(row.lease_id)
        waiter.row = row = _with(row, lease_id=new_lease_id(), providers=providers)
        core.in_flight.add(row.lease_id)
        await core.store.waiters.retarget(row.waiter_id, row.lease_id, providers)
        await core.announce_freed()
        return None

    async def _finish(
        self, request: LeaseRequest, attempt: Attempt, lease_id: str
    ) -> LeaseRecord | None:
        core = self.core
        granted = await core.store.get(lease_id)
        if granted is None:
            return None
        if granted.state == LeaseState.active.value:
            return granted  # a static endpoint: active in the grant's transaction
        if granted.state != LeaseState.provisioning.value:
            attempt.failures[granted.provider] = "resolved while waiting to be provisioned"
            return None
        pool = self.acquirer.pool
        if granted.probe_url is not None and pool is not None:  # an idle pool worker
            record = await pool.hand_off(granted, request)
            if record is None:
                attempt.reasons["pool"] = "its worker failed the hand-off"
            return record
        provider = core.by_name.get(granted.provider)
        if provider is None:
            return None
        record = await Cold(core, provider, pool).make(attempt, granted)
        if record is None and granted.provider not in attempt.failures:
            attempt.failures[granted.provider] = attempt.reasons.get(
                granted.provider, "provision failed"
            )
        if record is None:
            await core.store.fail(
                lease_id, states.FAIL, error=attempt.failures[granted.provider], now=core.now_us()
            )
            core.capacity_freed()
        return record

    async def _refused(
        self, request: LeaseRequest, attempt: Attempt, refusal: dict[str, Any]
    ) -> Exception:
        kind = refusal.get("kind")
        if kind == "quota":
            return self.acquirer.over_quota(OverQuota(str(refusal["message"])))
        if kind == "budget":
            attempt.reasons.update(refusal.get("reasons") or {})
            attempt.over_budget.append(
                OverBudget(
                    str(refusal["message"]),
                    cap=str(refusal["cap"]),
                    limit=float(refusal["limit"]),
                    figure=0.0,
                    price=float(refusal["price"]),
                )
            )
            return await self.acquirer.over_budget(request, attempt)
        if kind == "duplicate":
            return NoProviderAvailable(
                f"another acquire of the same request holds lease {refusal['lease_id']}; "
                "retry to be given it",
                at_capacity=True,
            )
        attempt.reasons.update(refusal.get("reasons") or {})
        attempt.at_capacity = True
        return self.acquirer.no_lease(request, attempt)

    def _waited_out(
        self, request: LeaseRequest, attempt: Attempt, waited: float, position: int | None
    ) -> NoProviderAvailable:
        self.core.metrics.refused_at_capacity(request.kind.value, request.gpu.value)
        where = f" at position {position}" if position is not None else ""
        why = "; ".join(f"{name}: {reason}" for name, reason in attempt.reasons.items())
        return NoProviderAvailable(
            f"no room for kind={request.kind.value} gpu={request.gpu.value} within "
            f"{waited:.0f} s in line{where}" + (f" ({why})" if why else ""),
            at_capacity=True,
            position=position,
            reasons=attempt.reasons,
        )

    async def _make_room(self, row: WaitingRow) -> None:
        """Room in this replica's line for `row`, a lower caller pushed out if needed."""
        line = self.core.line
        pushed = line.make_room(row)
        if pushed is None:
            return
        position = await self.position(pushed.waiter_id)  # read while it is in line
        decision = await self.core.store.waiters.take_back(pushed.waiter_id)
        if decision is not None:
            line.dispatch([decision])  # granted meanwhile: it is served, not pushed out
            raise LineFull(
                f"{len(line)} callers wait in line here already "
                f"(MAX_WAITING_CALLERS = {line.most}); try again later",
                limit=line.most,
            )
        line.push_out(
            pushed,
            LineFull(
                f"pushed out of a full line (MAX_WAITING_CALLERS = {line.most}) by a caller "
                f"of a higher class (class {row.priority_class})",
                limit=line.most,
                position=position,
            ),
        )

    async def position(self, waiter_id: str, at: int | None = None) -> int | None:
        """Where `waiter_id` stands in the line now (or at `at`, µs, if earlier; 1:
        next), None when not in it."""
        rows = await self.line_now(at)
        return next((i + 1 for i, r in enumerate(rows) if r.waiter_id == waiter_id), None)

    async def line_now(self, at: int | None = None) -> list[WaitingRow]:
        """The whole line, in admission order (as of `at`, if earlier than now)."""
        core = self.core
        now = core.now_us() if at is None else min(at, core.now_us())
        rows = await core.store.waiters.line(alive_since=core.line_alive_since(now), now=now)
        return order(rows, core.priorities.rank(), now, int(core.line_aging * 1e6))

    async def with_retry_after(
        self, exc: NoProviderAvailable | LineFull
    ) -> NoProviderAvailable | LineFull:
        """The final 503, with a `Retry-After`: when the line is likely to have come to
        the caller (its position, at the pace callers here are served), else when the
        next lease is due to end."""
        core = self.core
        reason = "line_full" if isinstance(exc, LineFull) else "no_provider"
        core.metrics.acquire_failures.labels(reason).inc()
        position = exc.details.get("position")
        if position is None and isinstance(exc, LineFull):
            position = len(await self.line_now()) + 1
        due = await core.store.next_due()
        seconds = retry_after(position, core.line.pace(), due, core.now_us())
        exc.headers["Retry-After"] = str(seconds)
        return exc

    # --- decisions reach their callers --------------------------------------------------

    def collect_soon(self) -> None:
        """The line may have moved: the decisions on this replica's callers are read (one
        read at a time; one more after it when asked meanwhile)."""
        if not self.core.line.waiters:
            return
        if self._collecting:
            self._again = True
            return
        self._collecting = True
        asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self) -> None:
        try:
            while True:
                self._again = False
                try:
                    self.core.line.dispatch(await self.core.store.waiters.decided())
                except Exception:  # noqa: BLE001 - a store outage: the next wake reads again
                    log.debug("decisions not read", exc_info=True)
                if not self._again:
                    return
        finally:
            self._collecting = False


def _with(row: WaitingRow, **changes: Any) -> WaitingRow:
    from dataclasses import replace

    return replace(row, **changes)


__all__ = ["Waiting", "VERDICT_S", "lease_ref"]
