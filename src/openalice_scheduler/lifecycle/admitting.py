"""The admission loop (docs/concepts/priorities.md#the-admission-loop): one decides who
gets a room, for the whole line at once. It runs on one replica (the leader, loops/
admission.py) and is woken by a new waiter or a freed room.

A pass reads the line and every live lease once, orders the line (line.order: class,
then arrival, with aging), and walks it. For each caller it looks, on a picture of the
cluster kept in memory (`Picture`), for a room that fits it after every admission rule
(admission.py: the owner's quota, the provider's cap and devices, the owner's $/h and
$/day): an idle pool worker of its shape first, then each provider it may use, in the
policy's order. Where the picture says it fits, the grant is one transaction that checks
everything again under the locks and writes the loop's decision on the caller's row
(a guarded update: no grant for a caller who left). A caller that fits nowhere does not
hold back those behind it.

A caller that waits and fits nowhere speaks for a room already being freed that would
fit it (a lease `preempting` or `releasing`), so that no caller behind it counts that
room too. A caller of a class that preempts, with none, then takes a pool worker's room
(an idle one is recycled, a warming one cancelled), and only then displaces one lease
of a lower, preemptible class: the lowest class first, then the most recently granted
(the least work lost), on the first provider where that lease's end makes room and the
caller's caps allow the price. Never two victims for one caller in a pass; a victim
whose caller left is simply a room being freed, adopted by the next who needs one.
Refills of the warm pool take rooms only while nobody waits (admission.reserve_warm).

A caller over its quota, or over its caps in money on every provider that has room for
it, is refused at once; a caller that does not wait (`wait_seconds` 0) and fits nowhere
is refused with each provider's reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from openalice_scheduler.errors import LeaseNotFound
from openalice_scheduler.lifecycle import admission, states
from openalice_scheduler.lifecycle.admission import ForWaiter, Left, reservation_terms
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.ending import Ending
from openalice_scheduler.lifecycle.line import order
from openalice_scheduler.lifecycle.picture import Picture
from openalice_scheduler.lifecycle.pooling import Pool
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.models import GpuClass, LeaseState, ReleaseReason, WorkerKind
from openalice_scheduler.providers import InstantProvider, Provider, WorkerSpec
from openalice_scheduler.store import (
    AtCapacity,
    DuplicateRequest,
    LeaseRecord,
    NewLease,
    OverBudget,
    OverQuota,
    Terms,
)
from openalice_scheduler.store.records import Budget
from openalice_scheduler.store.waiters import WaitingRow

log = logging.getLogger("openalice_scheduler.waiting")

S = LeaseState
# Rooms being freed: their workers are going (or told to go); pool workers' rooms.
FREEING = frozenset({S.preempting.value, S.releasing.value})
POOLED = frozenset(s.value for s in states.POOLED)
# Within a pass, other replicas are told of its decisions at most this often (one
# NOTIFY each); this replica's callers are told of each at once.
TELL_EVERY_S = 0.02
# A pass gives the event loop back at least every this many turns.
YIELD_EVERY = 100


@dataclass
class Verdict:
    """What one caller's turn in a pass came to."""

    granted: bool = False
    reasons: dict[str, str] = field(default_factory=dict)
    over_budget: list[OverBudget] = field(default_factory=list)
    at_capacity: bool = False


class Admitting:
    def __init__(self, core: Core, ending: Ending) -> None:
        self.core = core
        self.ending = ending
        self.pool: Pool | None = None
        self.passes = 0
        self.admitted = 0  # callers granted a room, since start
        self._told = 0.0  # when other replicas were last told of a decision

    async def admit(self) -> int:
        """One pass over the whole line: the callers granted (or refused) a room."""
        core = self.core
        now = core.now_us()
        await self._unclaimed(now)
        rows = await core.store.waiters.line(alive_since=core.line_alive_since(now), now=now)
        self.passes += 1
        if not rows:
            return 0
        live = await core.store.live()
        picture = Picture(live, await self._spent({r.owner_id for r in rows}, now))
        spoken: set[str] = set()  # rooms being freed, already counted for a caller ahead
        terms: dict[tuple[str, str, str, str | None], Terms | None] = {}
        decided = 0
        ranks = core.priorities.rank()
        for turn, row in enumerate(order(rows, ranks, now, int(core.line_aging * 1e6))):
            if await self._turn(row, picture, spoken, terms, now):
                decided += 1
                await self._tell()
            elif turn % YIELD_EVERY == YIELD_EVERY - 1:
                # A turn that writes nothing never gives the event loop back: a pass over
                # a long line would hold every other request (GET /health) until its end.
                await asyncio.sleep(0)
        if decided:
            self.admitted += decided
            await core.announce_decided()
        return decided

    async def _unclaimed(self, now: int) -> None:
        """Rooms granted to callers whose replica died before they took them, given
        back: a lease already active (a static endpoint's) ends, as nobody holds it; a
        provision left half-made is the reconciler's, as any dead replica's."""
        store = self.core.store
        alive_since = self.core.line_alive_since(now)
        for decision in await store.waiters.unclaimed(alive_since=alive_since):
            if await store.waiters.take_back(decision.waiter_id) is None:
                continue  # its caller took it meanwhile: its replica lives
            record = await store.get(decision.granted) if decision.granted else None
            if record is None or record.state != S.active.value:
                continue
            log.info(
                "lease %s was granted to a caller whose replica died: released",
                lease_ref(record),
            )
            with contextlib.suppress(LeaseNotFound):
                await self.ending.end(record.lease_id, None, ReleaseReason.orphan)

    async def _tell(self) -> None:
        """A decision reaches its caller while the pass goes on over the rest of the
        line (a long line takes a while): this replica's callers read it at once, other
        replicas are told at most every TELL_EVERY_S, and all at the pass's end."""
        self.core.wake_line()
        if time.monotonic() - self._told >= TELL_EVERY_S:
            self._told = time.monotonic()
            await self.core.store.announce_capacity()

    async def _spent(self, owners: set[str | None], now: int) -> dict[str, float]:
        """The last day's spend of each owner in line with a cap on it."""
        spent: dict[str, float] = {}
        for owner in owners:
            budget = self.core.budgets.of(owner)
            if owner is not None and budget is not None and budget.per_day:
                spent[owner] = (await self.core.store.owner_money(owner, now=now))[1]
        return spent

    async def _turn(
        self,
        row: WaitingRow,
        picture: Picture,
        spoken: set[str],
        terms: dict[tuple[str, str, str, str | None], Terms | None],
        now: int,
    ) -> int:
        core = self.core
        new = NewLease(
            lease_id=row.lease_id,
            kind=row.kind,
            gpu=row.gpu,
            owner_id=row.owner_id,
            correlation_id=row.correlation_id,
            region=row.region,
            ttl_seconds=row.ttl_seconds,
            created_at=now,
            expires_at=now + row.ttl_seconds * 1_000_000,
            priority_class=row.priority_class,
            requested_at=row.arrived_at,
        )
        budget = core.budgets.of(row.owner_id)
        verdict = Verdict()
        try:
            admission.admit_owner(picture, new, core.max_leases_per_owner)
            if row.pooled and await self._from_pool(row, new, budget, picture, verdict, now):
                return 1
            for name in row.providers:
                provider = core.by_name.get(name)
                term = await self._terms(provider, row, now, terms) if provider else None
                if provider is None or term is None:
                    continue
                term = _priced(term, budget, now)
                if await self._on_provider(row, new, provider, term, picture, verdict):
                    return 1
        except OverQuota as exc:
            return await self._refuse(row, {"kind": "quota", "message": exc.message}, now)
        except DuplicateRequest as exc:
            return await self._refuse(row, {"kind": "duplicate", "lease_id": exc.lease_id}, now)
        except Left:
            return 0
        if verdict.over_budget and not verdict.at_capacity:
            cheapest = min(verdict.over_budget, key=lambda e: e.price)
            refusal = {
                "kind": "budget",
                "message": cheapest.message,
                "cap": cheapest.cap,
                "limit": cheapest.limit,
                "price": cheapest.price,
                "reasons": verdict.reasons,
            }
            return await self._refuse(row, refusal, now)
        if not row.patient:
            refusal = {"kind": "no_room", "reasons": verdict.reasons, "at_capacity": True}
            return await self._refuse(row, refusal, now)
        await self._seat(row, new, budget, picture, spoken, terms, now)
        return 0

    async def _from_pool(
        self,
        row: WaitingRow,
        new: NewLease,
        budget: Budget | None,
        picture: Picture,
        verdict: Verdict,
        now: int,
    ) -> bool:
        idle = [
            r
            for r in picture.records.values()
            if r.state == S.idle.value and (r.kind, r.gpu, r.region) == (row.kind, row.gpu, None)
        ]
        if not idle:
            return False
        if budget is not None:
            cheapest = min((r.price_per_hour or 0.0) for r in idle)
            try:
                admission.admit_price(picture, new, cheapest, budget, now)
            except OverBudget as exc:
                verdict.over_budget.append(exc)
                return False
        core = self.core
        tx = admission.claim_idle(
            new,
            core.max_leases_per_owner,
            budget,
            states.CLAIM,
            waiter=ForWaiter(row.waiter_id, now),
        )
        try:
            claimed = await core.store.reserve(new, tx, replica_id=row.replica_id)
        except OverBudget as exc:
            verdict.over_budget.append(exc)
            return False
        if claimed is None:
            return False
        picture.add(claimed)
        log.info(
            "caller in line (class %s) granted pool worker %s",
            row.priority_class,
            lease_ref(claimed),
        )
        return True

    async def _on_provider(
        self,
        row: WaitingRow,
        new: NewLease,
        provider: Provider,
        terms: Terms,
        picture: Picture,
        verdict: Verdict,
    ) -> bool:
        """Whether `row` was granted a room on `provider` (its reason noted if not)."""
        name = provider.name
        shape = (name, row.kind, row.gpu, row.region)
        if shape in picture.full:  # no room for this shape, the picture unchanged since
            if not self._affordable(picture, new, terms, verdict, name):
                return False
            verdict.reasons[name], verdict.at_capacity = picture.full[shape], True
            return False
        try:
            grant = admission.admit_provider(picture, new, name, terms)
            if terms.budget is not None:
                admission.admit_price(picture, new, grant.price, terms.budget, terms.now)
        except AtCapacity as exc:
            picture.full[shape] = exc.message
            if not self._affordable(picture, new, terms, verdict, name):
                return False  # no room it frees would do: its caps refuse the price
            verdict.reasons[name], verdict.at_capacity = exc.message, True
            return False
        except OverBudget as exc:
            verdict.reasons[name] = exc.message
            verdict.over_budget.append(exc)
            return False
        instant = isinstance(provider, InstantProvider)
        tx = admission.reserve(
            new,
            name,
            terms,
            states.ASSIGN if instant else states.RESERVE,
            provider.assign if isinstance(provider, InstantProvider) else None,
            waiter=ForWaiter(row.waiter_id, terms.now),
        )
        try:
            record = await self.core.store.reserve(new, tx, replica_id=row.replica_id)
        except AtCapacity as exc:  # the picture was behind: the transaction decides
            verdict.reasons[name], verdict.at_capacity = exc.message, True
            return False
        except OverBudget as exc:
            verdict.reasons[name] = exc.message
            verdict.over_budget.append(exc)
            return False
        picture.add(record)
        log.info(
            "caller in line (class %s, %s, gpu=%s) granted lease %s on %s",
            row.priority_class,
            row.kind,
            row.gpu,
            lease_ref(record),
            name,
        )
        return True

    @staticmethod
    def _affordable(
        picture: Picture, new: NewLease, terms: Terms, verdict: Verdict, name: str
    ) -> bool:
        """Whether `new`'s caps allow the price of a room on provider `name` once one
        is free (a fleet's price is its place's: allowed here); its reason noted if not."""
        if terms.budget is None or terms.place is not None:
            return True
        try:
            admission.admit_price(picture, new, terms.price_per_hour, terms.budget, terms.now)
        except OverBudget as exc:
            verdict.reasons[name] = exc.message
            verdict.over_budget.append(exc)
            return False
        return True

    async def _refuse(self, row: WaitingRow, refusal: dict[str, object], now: int) -> int:
        done = await self.core.store.waiters.refuse(row.waiter_id, json.dumps(refusal), now=now)
        return 1 if done else 0

    async def _terms(
        self,
        provider: Provider,
        row: WaitingRow,
        now: int,
        cache: dict[tuple[str, str, str, str | None], Terms | None],
    ) -> Terms | None:
        key = (provider.name, row.kind, row.gpu, row.region)
        if key not in cache:
            spec = WorkerSpec(
                lease_id=row.lease_id,
                kind=WorkerKind(row.kind),
                gpu=GpuClass(row.gpu),
                expires_at=datetime.fromtimestamp(now / 1e6 + row.ttl_seconds, UTC),
                region=row.region,
                priority_class=row.priority_class,
            )
            cache[key] = reservation_terms(
                provider,
                spec,
                now=now,
                owner_quota=self.core.max_leases_per_owner,
                price=await provider.price(spec),
            )
        return cache[key]

    # --- a room for a caller who fits nowhere now -------------------------------------

    async def _seat(
        self,
        row: WaitingRow,
        new: NewLease,
        budget: Budget | None,
        picture: Picture,
        spoken: set[str],
        terms: dict[tuple[str, str, str, str | None], Terms | None],
        now: int,
    ) -> None:
        """A room being freed that fits `row` is spoken for; else, for a class that
        preempts, a pool worker's room is taken back, else one lease displaced."""
        core = self.core
        cls = core.priorities.classes.get(row.priority_class)
        preempts = cls is not None and cls.preempts
        lower = (
            {
                c.name
                for c in core.priorities.classes.values()
                if c.preemptible and c.value < cls.value
            }
            if cls is not None and preempts
            else set()
        )
        steps = [FREEING, POOLED, {S.active.value}] if preempts else [FREEING]
        for step in steps:
            for name in row.providers:
                provider = core.by_name.get(name)
                term = await self._terms(provider, row, now, terms) if provider else None
                if provider is None or term is None:
                    continue
                term = _priced(term, budget, now)
                for room in self._rooms(picture, name, step, lower, spoken):
                    if not self._would_fit(picture, new, name, term, room):
                        continue
                    if step is FREEING:
                        spoken.add(room.lease_id)
                        return
                    if await self._free(room, row, cls.name if cls else "", picture, now):
                        spoken.add(room.lease_id)
                        return
                    if room.state == S.active.value:
                        # It ended meanwhile: its room is this caller's, at the next pass
                        # (the picture still counts it held, so nobody behind takes it).
                        spoken.add(room.lease_id)
                        return

    def _rooms(
        self,
        picture: Picture,
        provider: str,
        step: AbstractSet[str],
        lower: set[str],
        spoken: set[str],
    ) -> list[LeaseRecord]:
        rooms = [r for r in picture.in_states(provider, step) if r.lease_id not in spoken]
        if S.active.value in step:
            classes = self.core.priorities.classes
            rooms = [r for r in rooms if r.priority_class in lower]
            rooms.sort(key=lambda v: (classes[v.priority_class].value, -(v.granted_at or 0)))
        return rooms

    @staticmethod
    def _would_fit(
        picture: Picture, new: NewLease, provider: str, terms: Terms, room: LeaseRecord
    ) -> bool:
        """Whether the end of `room` makes room for `new` on `provider`, at a price its
        caps allow."""
        try:
            grant = admission.admit_provider(picture, new, provider, terms, freeing=room)
            if terms.budget is not None:
                admission.admit_price(picture, new, grant.price, terms.budget, terms.now)
        except (AtCapacity, OverBudget):
            return False
        return True

    async def _free(
        self, room: LeaseRecord, row: WaitingRow, by_class: str, picture: Picture, now: int
    ) -> bool:
        """`room` given up for `row`: a pool worker recycled (idle) or cancelled
        (warming), an active lease preempted. Whether it was."""
        core = self.core
        if room.state in POOLED:
            if self.pool is None or not await self.pool.give_up(room):
                return False
            log.info(
                "pool worker %s given up for a caller in line (class %s)",
                lease_ref(room),
                row.priority_class,
            )
            picture.add(replace(room, state=S.releasing.value))
            return True
        grace = int(core.preemption_grace * 1e6)
        victim = await core.store.reserve(
            NewLease(row.lease_id, row.kind, row.gpu, None, None, None, 1, now, now),
            admission.preempt(
                room.lease_id, states.PREEMPT, preempt_at=now + grace, by=row.waiter_id, now=now
            ),
        )
        if victim is None:  # it ended meanwhile: its room is free, for the next pass
            core.wake_line()
            return False
        self.ending.preempted(victim, by_class)
        picture.add(victim)
        return True


def _priced(terms: Terms, budget: Budget | None, now: int) -> Terms:
    """`terms` with the caller's budget: the same object when nothing differs (most
    callers have no cap: a copy per caller per provider was a fifth of a long pass)."""
    if terms.budget is budget and terms.now == now:
        return terms
    return replace(terms, budget=budget, now=now)
