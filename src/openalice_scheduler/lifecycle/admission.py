"""Who may take capacity, and on what terms: the rules a lease's reservation must meet,
written once here. Each reservation is one transaction, composed here and run by the
store (`LeaseStore.reserve`, `PoolStore.claim`) over the facts it reads (store/
reserving.py): under the owner's lock, no second lease for the same request and the
owner's quota of live leases; under the provider's lock, its cap on live workers and
its exclusive devices (or a fleet's placement); then the owner's caps in money at the
price of the place given. Every replica takes the same locks, so the checks hold across
replicas. The terms of one reservation are `Terms`; an owner's caps `Budgets`.

The same checks run twice for a caller in line: first on the admission loop's picture
of the cluster (lifecycle/admitting.py), to find where it fits without a transaction
per waiter; then in the transaction that grants it, which decides. A caller who does
not wait in line reserves directly only while nobody waits (`FirstInLine`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from openalice_scheduler.errors import ClassNotAllowed, Forbidden, InvalidRequest
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


class Facts(Protocol):
    """What the admission rules ask of the cluster: a reserving transaction
    (store.Reserving) answers under its locks, the admission loop's picture
    (picture.Picture) from memory."""

    def lock(self, key: str) -> None: ...
    def twin(self, lease: NewLease) -> str | None: ...
    def held(self, lease: NewLease) -> int: ...
    def live_on(self, lease: NewLease, provider: str) -> int: ...
    def taken_on(self, lease: NewLease, provider: str) -> set[str]: ...
    def owner_price(self, lease: NewLease) -> float: ...
    def owner_spent(self, lease: NewLease, since: int, now: int) -> float: ...


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
class FirstInLine:
    """A reservation made outside the line: refused (Behind) when any caller waits in
    line on a replica alive since `alive_since`, at `now`: the admission loop serves
    them first."""

    alive_since: int
    now: int


@dataclass(frozen=True, slots=True)
class ForWaiter:
    """A reservation the admission loop makes for the caller `waiter_id`: its decision
    is written in the same transaction (no reservation for a caller who left)."""

    waiter_id: str
    now: int


class Left(Exception):
    """The caller left the line before the loop's reservation for it was written."""


def _in_line(r: Reserving, first: FirstInLine | None) -> None:
    if first is not None and r.someone_waits(alive_since=first.alive_since, now=first.now):
        raise Behind("callers wait in line: the admission loop serves them first")


def _granted(r: Reserving, waiter: ForWaiter | None, lease_id: str) -> None:
    if waiter is not None and not r.decide(waiter.waiter_id, lease_id, None, waiter.now):
        raise Left(waiter.waiter_id)


def reserve(
    lease: NewLease,
    provider: str,
    terms: Terms,
    move: Move,
    assign: Assign | None = None,
    first: FirstInLine | None = None,
    waiter: ForWaiter | None = None,
    freeing: LeaseRecord | None = None,
) -> Callable[[Reserving], LeaseRecord]:
    """A lease's reservation on `provider`, recorded by `move`: the owner's checks, the
    provider's, the line's (with `first`: nobody waits), the owner's caps in money,
    then the row (with `waiter`: and the loop's decision for that caller). With
    `assign` (a provider whose workers already run), the lease is granted its worker
    in the same transaction. With `freeing` (a pool worker claimed for destruction),
    the room it holds is taken over: never free in between for anyone else."""

    def tx(r: Reserving) -> LeaseRecord:
        admit_owner(r, lease, terms.owner_quota)
        r.lock(f"provider:{provider}")
        grant = admit_provider(r, lease, provider, terms, freeing)
        _in_line(r, first)
        if terms.budget is not None:  # still under the owner's lock
            admit_price(r, lease, grant.price, terms.budget, terms.now)
        worker = None if assign is None else assign(grant.resource)
        record = r.write(lease, provider, move, grant, terms.now, worker)
        _granted(r, waiter, record.lease_id)
        return record

    return tx


def reserve_warm(
    lease: NewLease, provider: str, terms: Terms, target: int, move: Move, first: FirstInLine
) -> Callable[[Reserving], LeaseRecord | None]:
    """A warm-pool worker's reservation (no owner): when its kind and GPU class have
    fewer than `target` pool workers, checked under a lock of that pool (exact across
    replicas), then as any lease's; None when the pool is full. A refill is the line's
    last consumer: Behind while anyone waits in line."""

    def tx(r: Reserving) -> LeaseRecord | None:
        r.lock(f"pool:{lease.kind}/{lease.gpu}")
        if r.pooled(lease.kind, lease.gpu) >= target:
            return None
        return reserve(lease, provider, terms, move, first=first)(r)

    return tx


def claim_idle(
    lease: NewLease,
    quota: int,
    budget: Budget | None,
    move: Move,
    first: FirstInLine | None = None,
    waiter: ForWaiter | None = None,
) -> Callable[[Reserving], LeaseRecord | None]:
    """The oldest idle pool worker of `lease.kind`/`lease.gpu`, claimed by `move` for
    the request `lease` describes, under the owner's lock with the checks of a cold
    reservation: no second lease for the request, the owner's quota, the line's (with
    `first`: nobody waits), its caps in money at that worker's price; with `waiter`,
    the loop's decision for that caller. None when no idle worker is left."""

    def tx(r: Reserving) -> LeaseRecord | None:
        admit_owner(r, lease, quota)
        oldest = r.oldest_idle(lease.kind, lease.gpu)
        if oldest is None:
            return None
        worker_id, provider, price = oldest
        _in_line(r, first)
        if budget is not None:
            admit_price(r, lease, price, budget, lease.created_at)
        claimed = r.claim(worker_id, lease, move)
        if claimed is not None:
            _granted(r, waiter, claimed.lease_id)
        return claimed

    return tx


def admit_owner(r: Facts, lease: NewLease, quota: int) -> None:
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
    r: Facts,
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


def preempt(
    victim: str, move: Move, *, preempt_at: int, by: str, now: int
) -> Callable[[Reserving], LeaseRecord | None]:
    """`victim` displaced by `move` for the caller `by` (its waiter id) as one guarded
    update: None when it is no longer active (released meanwhile: its room is free)."""

    def tx(r: Reserving) -> LeaseRecord | None:
        return r.preempt(victim, move, preempt_at=preempt_at, by=by, now=now)

    return tx


def admit_price(r: Facts, lease: NewLease, price: float | None, budget: Budget, now: int) -> None:
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
    a request's class is the one it names, else its owner's, else `default`. An
    owner's class is also the highest it may name (a class is a right, not a wish);
    owners not listed, and requests without an owner, may name up to `unlisted`
    (UNLISTED_OWNER_MAX_CLASS, `default` unless set)."""

    def __init__(
        self,
        classes: dict[str, PriorityClass] | None = None,
        owners: dict[str, str] | None = None,
        unlisted: str = DEFAULT_CLASS,
    ) -> None:
        self.classes = classes or {DEFAULT_CLASS: PriorityClass(DEFAULT_CLASS, 0)}
        self.owners = owners or {}
        self.unlisted = unlisted if unlisted in self.classes else DEFAULT_CLASS

    def of(self, named: str | None, owner: str | None) -> PriorityClass:
        """The class of a request naming `named` (None: none) for `owner`; an unknown
        name is an InvalidRequest naming the valid ones, one above the owner's ceiling
        a ClassNotAllowed naming the ceiling."""
        own = self.owners.get(owner or "")
        if named is None:
            return self.classes[own or DEFAULT_CLASS]
        found = self.classes.get(named)
        if found is None:
            raise InvalidRequest(
                f"priority_class: {named!r} is not a class of this scheduler; its "
                f"classes (PRIORITY_CLASSES): {', '.join(sorted(self.classes))}",
                field="priority_class",
            )
        ceiling = self.classes[own or self.unlisted]
        if found.value > ceiling.value:
            who = f"owner {owner!r}" if owner else "a request without owner_id"
            source = "OWNER_PRIORITY_CLASSES" if own else "UNLISTED_OWNER_MAX_CLASS"
            raise ClassNotAllowed(
                f"priority_class {named!r} is above what {who} may ask for: its ceiling "
                f"is {ceiling.name!r} ({source})",
                ceiling=ceiling.name,
            )
        return found

    def rank(self) -> list[str]:
        """The class names from the lowest value to the highest (aging climbs it)."""
        return [c.name for c in sorted(self.classes.values(), key=lambda c: c.value)]
