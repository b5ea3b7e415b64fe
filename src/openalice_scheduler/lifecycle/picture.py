"""The cluster as one pass of the admission loop sees it (admitting.py,
docs/concepts/priorities.md#the-admission-loop): every live lease, indexed the way the
admission rules ask, kept in memory for the pass and brought up to date by its grants."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Set as AbstractSet

from openalice_scheduler.lifecycle import states
from openalice_scheduler.store import LeaseRecord, NewLease


class Picture:
    """The cluster as one pass of the loop sees it: every live lease, indexed the way
    the admission rules ask (the same questions `Reserving` answers in a transaction),
    and brought up to date by the pass's own grants."""

    def __init__(self, live: list[LeaseRecord], spent: dict[str, float]) -> None:
        self.records: dict[str, LeaseRecord] = {}
        self._on: dict[str, set[str]] = defaultdict(set)  # provider: lease ids
        self._in: dict[tuple[str, str], set[str]] = defaultdict(set)  # (provider, state): ids
        # Why a provider had no room for a shape (provider, kind, gpu, region): found on
        # the picture as it is, it holds for every caller of that shape until a change.
        self.full: dict[tuple[str, str, str, str | None], str] = {}
        self._spent = spent
        for record in live:
            self.add(record)

    def add(self, record: LeaseRecord) -> None:
        self.drop(record.lease_id)
        if record.state in states.HOLDS_CAPACITY:
            self.records[record.lease_id] = record
            self._on[record.provider].add(record.lease_id)
            self._in[record.provider, record.state].add(record.lease_id)

    def drop(self, lease_id: str) -> None:
        """`lease_id` out of the picture (it ended), every index with it."""
        old = self.records.pop(lease_id, None)
        if old is not None:
            self._on[old.provider].discard(lease_id)
            self._in[old.provider, old.state].discard(lease_id)
        self.full.clear()

    def on(self, provider: str) -> list[LeaseRecord]:
        return [self.records[i] for i in self._on.get(provider, ())]

    def in_states(self, provider: str, wanted: AbstractSet[str]) -> list[LeaseRecord]:
        """The leases on `provider` in one of the states `wanted`."""
        return [self.records[i] for s in wanted for i in self._in.get((provider, s), ())]

    # --- what the admission rules ask (admission.Facts) --------------------------------

    def lock(self, key: str) -> None:
        """Nothing to lock: the transaction that grants takes the locks."""

    def twin(self, lease: NewLease) -> str | None:
        if not (lease.owner_id and lease.correlation_id):
            return None
        return next(
            (
                r.lease_id
                for r in self.records.values()
                if r.owner_id == lease.owner_id
                and r.correlation_id == lease.correlation_id
                and r.state in states.ANSWERED
                and r.lease_id != lease.lease_id
            ),
            None,
        )

    def held(self, lease: NewLease) -> int:
        return sum(
            1
            for r in self.records.values()
            if r.owner_id == lease.owner_id
            and r.state in states.HELD
            and r.lease_id != lease.lease_id
        )

    def live_on(self, lease: NewLease, provider: str) -> int:
        return len(self._on.get(provider, set()) - {lease.lease_id})

    def taken_on(self, lease: NewLease, provider: str) -> set[str]:
        return {
            r.resource for r in self.on(provider) if r.resource and r.lease_id != lease.lease_id
        }

    def owner_price(self, lease: NewLease) -> float:
        return sum(
            r.price_per_hour or 0.0
            for r in self.records.values()
            if r.owner_id == lease.owner_id
            and r.state in states.PAID
            and r.lease_id != lease.lease_id
        )

    def owner_spent(self, lease: NewLease, since: int, now: int) -> float:
        return self._spent.get(lease.owner_id or "", 0.0)
