"""The cluster as one pass of the admission loop sees it (admitting.py,
docs/concepts/priorities.md#the-admission-loop): every live lease, indexed the way the
admission rules ask, kept in memory for the pass and brought up to date by its grants."""

from __future__ import annotations

from collections import defaultdict

from openalice_scheduler.lifecycle import states
from openalice_scheduler.store import LeaseRecord, NewLease


class Picture:
    """The cluster as one pass of the loop sees it: every live lease, indexed the way
    the admission rules ask (the same questions `Reserving` answers in a transaction),
    and brought up to date by the pass's own grants."""

    def __init__(self, live: list[LeaseRecord], spent: dict[str, float]) -> None:
        self.records: dict[str, LeaseRecord] = {}
        self._on: dict[str, set[str]] = defaultdict(set)  # provider: lease ids
        self._spent = spent
        for record in live:
            self.add(record)

    def add(self, record: LeaseRecord) -> None:
        old = self.records.get(record.lease_id)
        if old is not None:
            self._on[old.provider].discard(record.lease_id)
        if record.state in states.HOLDS_CAPACITY:
            self.records[record.lease_id] = record
            self._on[record.provider].add(record.lease_id)
        else:
            self.records.pop(record.lease_id, None)

    def on(self, provider: str) -> list[LeaseRecord]:
        return [self.records[i] for i in self._on.get(provider, ())]

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
