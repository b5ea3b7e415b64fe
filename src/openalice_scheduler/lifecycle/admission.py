"""Who may take capacity, and on what terms: the rules a lease's reservation must meet,
written once here. Each reservation is one transaction, composed here and run by the
store (`LeaseStore.reserve`, `PoolStore.claim`) over the facts it reads (store/
reserving.py): under the owner's lock, no second lease for the same request and the
owner's quota of live leases; under the provider's lock, its cap on live workers and
its exclusive devices (or a fleet's placement); then the owner's caps in money at the
price of the place given. Every replica takes the same locks, so the checks hold across
replicas. The terms of one reservation are `Terms`; an owner's caps `Budgets`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from openalice_scheduler.errors import Forbidden, InvalidRequest
from openalice_scheduler.models import GpuClass, WorkerKind
from openalice_scheduler.prices import parse_owner_budgets
from openalice_scheduler.priorities import DEFAULT_CLASS, PriorityClass
from openalice_scheduler.providers import PlacingProvider, Provider, WorkerSpec
from openalice_scheduler.store import (
    AtCapacity,
    DuplicateRequest,
    LeaseRecord,
    Move,
    NewLease,
    OverBudget,
    OverQuota,
)
from openalice_scheduler.store.records import Behind, Budget, Terms
from openalice_scheduler.store.reserving import Grant, Reserving
from openalice_scheduler.store.spending import DAY_US
from openalice_scheduler.store.waiters import WaitingRow

# A worker that already runs: its (endpoint, provider token) behind a reserved resource.
Assign = Callable[[str | None], tuple[str, str]]


def reservation_terms(
    provider: Provider,
    spec: WorkerSpec,
    *,
    now: int,
    owner_quota: int,
    price: float | None = None,
    budget: Budget | None = None,
) -> Terms:
    """What reserving `spec` on `provider` at `price` (its `price(spec)`) must respect.
    A placing provider's placer counts its caps itself, per place, and gives the price
    of the place it picks."""
    if isinstance(provider, PlacingProvider):
        return Terms(
            now=now,
            owner_quota=owner_quota,
            place=provider.placer(spec),
            price_per_hour=price,
            budget=budget,
        )
    return Terms(
        now=now,
        max_live=provider.max_workers,
        resources=provider.exclusive_resources(spec),
        resource_label=provider.resource_label,
        owner_quota=owner_quota,
        price_per_hour=price,
        budget=budget,
    )


@dataclass(frozen=True, slots=True)
class InLine:
    """Where the caller of a reservation stands in the line: its `priority` and
    `arrived_at` (µs), its own row (`waiter_id`, left out), read at `now` among the
    waiters of replicas alive since `alive_since`; `claims`, the lease it preempted
    (then no one in line is ahead of it: the room that lease frees is its own, as
    is any room it finds before that)."""

    priority: int
    arrived_at: int
    waiter_id: str
    claims: str | None
    alive_since: int
    now: int


def reserve(
    lease: NewLease,
    provider: str,
    terms: Terms,
    move: Move,
    assign: Assign | None = None,
    line: tuple[Provider, InLine] | None = None,
) -> Callable[[Reserving], LeaseRecord]:
    """A lease's reservation on `provider`, recorded by `move`: the owner's checks, the
    provider's, the line's (with `line`: no caller ahead could use the same capacity),
    the owner's caps in money, then the row. With `assign` (a provider whose workers
    already run), the lease is granted its worker in the same transaction."""

    def tx(r: Reserving) -> LeaseRecord:
        admit_owner(r, lease, terms.owner_quota)
        r.lock(f"provider:{provider}")
        grant = admit_provider(r, lease, provider, terms)
        if line is not None:
            admit_in_line(r, *line)
        if terms.budget is not None:  # still under the owner's lock
            admit_price(r, lease, grant.price, terms.budget, terms.now)
        worker = None if assign is None else assign(grant.resource)
        return r.write(lease, provider, move, grant, terms.now, worker)

    return tx


def reserve_warm(
    lease: NewLease, provider: str, terms: Terms, target: int, move: Move
) -> Callable[[Reserving], LeaseRecord | None]:
    """A warm-pool worker's reservation (no owner): when its kind and GPU class have
    fewer than `target` pool workers, checked under a lock of that pool (exact across
    replicas), then as any lease's; None when the pool is full."""

    def tx(r: Reserving) -> LeaseRecord | None:
        r.lock(f"pool:{lease.kind}/{lease.gpu}")
        if r.pooled(lease.kind, lease.gpu) >= target:
            return None
        return reserve(lease, provider, terms, move)(r)

    return tx


def claim_idle(
    lease: NewLease,
    quota: int,
    budget: Budget | None,
    move: Move,
    line: InLine | None = None,
) -> Callable[[Reserving], LeaseRecord | None]:
    """The oldest idle pool worker of `lease.kind`/`lease.gpu`, claimed by `move` for
    the request `lease` describes, under the owner's lock with the checks of a cold
    reservation: no second lease for the request, the owner's quota, the line's (with
    `line`: no caller ahead waits for such a worker), its caps in money at that worker's
    price. None when no idle worker is left."""

    def tx(r: Reserving) -> LeaseRecord | None:
        admit_owner(r, lease, quota)
        oldest = r.oldest_idle(lease.kind, lease.gpu)
        if oldest is None:
            return None
        worker_id, provider, price = oldest
        if line is not None and line.claims is None:
            for row in r.waiting_ahead(
                priority=line.priority,
                arrived_at=line.arrived_at,
                exclude=line.waiter_id,
                provider=provider,
                alive_since=line.alive_since,
                now=line.now,
            ):
                if (row.kind, row.gpu, row.region) == (lease.kind, lease.gpu, None):
                    raise Behind(
                        "a warm worker is idle, but a caller ahead in line (class "
                        f"{row.priority_class}) waits for it"
                    )
        if budget is not None:
            admit_price(r, lease, price, budget, lease.created_at)
        return r.claim(worker_id, lease, move)

    return tx


def admit_owner(r: Reserving, lease: NewLease, quota: int) -> None:
    """Takes the owner's lock, then refuses a second lease for the same request
    (DuplicateRequest) and an owner holding `quota` live leases (OverQuota)."""
    if not lease.owner_id:
        return
    r.lock(f"owner:{lease.owner_id}")
    twin = r.twin(lease)
    if twin is not None:
        raise DuplicateRequest(twin)
    if quota:
        held = r.held(lease)
        if held >= quota:
            raise OverQuota(
                f"owner {lease.owner_id!r} holds {held} leases; MAX_LEASES_PER_OWNER is {quota}"
            )


def admit_provider(
    r: Reserving,
    lease: NewLease,
    provider: str,
    terms: Terms,
    freeing: LeaseRecord | None = None,
) -> Grant:
    """Under the provider's lock: its cap on live workers, then one free exclusive
    resource (or a fleet's placement, which counts its caps itself, per place, and
    gives the price of the place it picks). AtCapacity says why none fits. With
    `freeing`: as if that lease held nothing (would its end make room?)."""
    gone = freeing is not None and freeing.provider == provider
    if terms.max_live:
        count = r.live_on(lease, provider) - (1 if gone else 0)
        if count >= terms.max_live:
            raise AtCapacity(f"at capacity ({count}/{terms.max_live} live workers)")
    price = terms.price_per_hour
    if terms.place is not None:
        taken = r.taken_on(lease, provider)
        if gone and freeing is not None:
            taken.discard(freeing.resource or "")
        placed = terms.place(taken)
        return Grant(placed.resource, placed.host, price if placed.price is None else placed.price)
    if terms.resources is not None:
        taken = r.taken_on(lease, provider)
        if gone and freeing is not None:
            taken.discard(freeing.resource or "")
        resource = next((res for res in terms.resources if res not in taken), None)
        if resource is None:
            raise AtCapacity(f"all {len(terms.resources)} {terms.resource_label} are leased")
        return Grant(resource, None, price)
    return Grant(None, None, price)


def admit_in_line(r: Reserving, provider: Provider, place: InLine) -> None:
    """Under the provider's lock, the room found: refuses (Behind) when a caller ahead
    in line, on any replica, could use it (the same provider serves its request, and
    its shape fits what is free: a waiter whose shape cannot be served holds no one
    back). The line is one, in order of priority then arrival. A caller that
    preempted a lease is behind no one (InLine.claims)."""
    if place.claims is not None:
        return
    for row in r.waiting_ahead(
        priority=place.priority,
        arrived_at=place.arrived_at,
        exclude=place.waiter_id,
        provider=provider.name,
        alive_since=place.alive_since,
        now=place.now,
    ):
        spec = WorkerSpec(
            lease_id=row.waiter_id,
            kind=WorkerKind(row.kind),
            gpu=GpuClass(row.gpu),
            expires_at=datetime.fromtimestamp(place.now / 1e6, UTC),
            region=row.region,
        )
        terms = reservation_terms(provider, spec, now=place.now, owner_quota=0)
        theirs = NewLease(
            row.waiter_id, row.kind, row.gpu, None, None, row.region, 1, place.now, place.now
        )
        try:
            admit_provider(r, theirs, provider.name, terms)
        except AtCapacity:
            continue  # what is free does not fit it: it holds no one back
        raise Behind(
            f"capacity is free, but a caller ahead in line (class {row.priority_class}) "
            "waits for it"
        )


@dataclass(frozen=True, slots=True)
class Displacing:
    """What a caller of a class that preempts asks, finding no room: who it is (`by`:
    its owner and correlation id, so that its retry finds its victim again, else its
    place in line), its class, and its row in the line (written with the victim)."""

    by: str
    cls: PriorityClass
    classes: dict[str, PriorityClass]
    row: WaitingRow
    grace_us: int
    now: int


def preempt(
    lease: NewLease, provider: str, terms: Terms, ask: Displacing, move: Move
) -> Callable[[Reserving], tuple[str, LeaseRecord | None]]:
    """For a caller of a class that preempts, finding `provider` full: under the owner's
    and the provider's locks, ("room", None) when there is room after all; else the
    lease already preempted for this request ("again", it), or one displaced now by
    `move` ("displaced", it): an active lease of a preemptible class of a lower value
    whose end makes room for this request, the lowest value first, then the most
    recently granted (the least work lost); ("none", None) when none would. The
    caller's row in the line claims the victim's capacity in the same transaction: once
    freed, it is this caller's and no one else's. One victim per caller, and never two
    callers on one victim (a guarded update, under the provider's lock)."""

    def tx(r: Reserving) -> tuple[str, LeaseRecord | None]:
        admit_owner(r, lease, terms.owner_quota)
        r.lock(f"provider:{provider}")
        try:
            admit_provider(r, lease, provider, terms)
            return "room", None
        except AtCapacity:
            pass
        again = r.displaced_for(ask.by)
        if again is not None:
            r.enter_line(replace(ask.row, claims=again.lease_id))
            return "again", again
        classes = ask.classes
        lower = [c.name for c in classes.values() if c.preemptible and c.value < ask.cls.value]
        candidates = sorted(
            r.displaceable(provider, lower),
            key=lambda v: (classes[v.priority_class].value, -(v.granted_at or 0)),
        )
        for victim in candidates:
            try:
                admit_provider(r, lease, provider, terms, freeing=victim)
            except AtCapacity:
                continue  # its end would not make room for this request
            displaced = r.preempt(
                victim.lease_id,
                move,
                preempt_at=ask.now + ask.grace_us,
                by=ask.by,
                now=ask.now,
            )
            if displaced is not None:
                r.enter_line(replace(ask.row, claims=victim.lease_id))
                return "displaced", displaced
        return "none", None

    return tx


def admit_price(
    r: Reserving, lease: NewLease, price: float | None, budget: Budget, now: int
) -> None:
    """Under the owner's lock: refuses with OverBudget when a lease at `price` would
    break `budget`. A free (or unpriced) lease breaks none: the owner is placed where it
    costs nothing."""
    owner = lease.owner_id
    if not price or not owner:
        return
    if budget.per_hour:
        held = r.owner_price(lease)
        if held + price > budget.per_hour + 1e-9:
            raise OverBudget(
                f"owner {owner!r}: its live leases cost {held:.4g} $/h; one more at "
                f"{price:.4g} $/h would make {held + price:.4g} $/h, over "
                f"{budget.hour_from} = {budget.per_hour:g} $/h",
                cap=budget.hour_from,
                limit=budget.per_hour,
                figure=held,
                price=price,
            )
    if budget.per_day:
        spent = r.owner_spent(lease, now - DAY_US, now)
        if spent >= budget.per_day:
            raise OverBudget(
                f"owner {owner!r} has spent {spent:.4g} $ in the last 24 h, "
                f"{budget.day_from} = {budget.per_day:g} $: no lease at {price:.4g} $/h "
                "until that falls below it",
                cap=budget.day_from,
                limit=budget.per_day,
                figure=spent,
                price=price,
            )


def check_owner(record: LeaseRecord, owner: str | None) -> None:
    """A lease with an owner is renewed and released only with its X-Lease-Owner."""
    if record.owner_id is not None and owner != record.owner_id:
        if owner is None:
            raise Forbidden(f"lease {record.lease_id} has an owner; send X-Lease-Owner")
        raise Forbidden(f"X-Lease-Owner does not match the owner of lease {record.lease_id}")


class Budgets:
    """Each owner's caps: its OWNER_BUDGETS entry, else the defaults."""

    def __init__(
        self, per_hour: float = 0.0, per_day: float = 0.0, owners: str | None = None
    ) -> None:
        self.default = Budget(per_hour, per_day)
        self.owners: dict[str, Budget] = {}
        for owner, (hour, day) in parse_owner_budgets(owners).items():
            self.owners[owner] = Budget(
                per_hour if hour is None else hour,
                per_day if day is None else day,
                hour_from=self.default.hour_from
                if hour is None
                else f"OWNER_BUDGETS ({owner}={_show(hour)}/h)",
                day_from=self.default.day_from
                if day is None
                else f"OWNER_BUDGETS ({owner}={_show(day)}/d)",
            )

    def of(self, owner: str | None) -> Budget | None:
        """The caps of `owner`; None when it has none (or the lease has no owner)."""
        if owner is None:
            return None
        budget = self.owners.get(owner, self.default)
        return budget if budget.per_hour or budget.per_day else None


def _show(amount: float) -> str:
    return str(int(amount)) if math.isclose(amount, round(amount)) else f"{amount:g}"


class Priorities:
    """The priority classes (PRIORITY_CLASSES) and each owner's (OWNER_PRIORITY_CLASSES):
    a request's class is the one it names, else its owner's, else `default`."""

    def __init__(
        self,
        classes: dict[str, PriorityClass] | None = None,
        owners: dict[str, str] | None = None,
    ) -> None:
        self.classes = classes or {DEFAULT_CLASS: PriorityClass(DEFAULT_CLASS, 0)}
        self.owners = owners or {}

    def of(self, named: str | None, owner: str | None) -> PriorityClass:
        """The class of a request naming `named` (None: none) for `owner`; an unknown
        name is an InvalidRequest naming the valid ones."""
        if named is not None:
            found = self.classes.get(named)
            if found is None:
                raise InvalidRequest(
                    f"priority_class: {named!r} is not a class of this scheduler; its "
                    f"classes (PRIORITY_CLASSES): {', '.join(sorted(self.classes))}",
                    field="priority_class",
                )
            return found
        return self.classes[self.owners.get(owner or "", DEFAULT_CLASS)]
