"""Usage over a period (GET /v1/usage) and the purge of ended leases past retention
(docs/concepts/money.md#usage-and-retention).

Both read or delete straight from the leases table over the store's backend: usage is a
report, not a state change, and the purge only removes rows no rule looks at any more."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, case, delete, select
from sqlalchemy.engine import Connection

from openalice_scheduler.models import GroupBy, LeaseState, UsageFigures
from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.schema import leases
from openalice_scheduler.store.spending import cost_of, held_us
from openalice_scheduler.store.statements import state_in
from openalice_scheduler.times import HOUR_US

# The column each grouping reads.
_GROUP_COLUMN = {
    "owner": leases.c.owner_id,
    "provider": leases.c.provider,
    "kind": leases.c.kind,
    "gpu": leases.c.gpu,
}
# Rows one purge transaction deletes at most: a big backlog never holds the table long.
PURGE_BATCH = 500


@dataclass
class Tally:
    """Leases, live ones among them, lease-hours and USD of one group (or of all)."""

    leases: int = 0
    live: int = 0
    lease_hours: float = 0.0
    cost: float = 0.0

    def add(self, live: bool, held: int, price: float | None) -> None:
        self.leases += 1
        self.live += live
        self.lease_hours += held / HOUR_US
        self.cost += cost_of(price, held)

    def figures(self) -> UsageFigures:
        """The figures as computed, not rounded: whoever shows them rounds once (a cost
        of 0.000150461 rounded here to 0.00015 showed as 0.0001, not 0.0002)."""
        return UsageFigures(
            leases=self.leases, live=self.live, lease_hours=self.lease_hours, cost=self.cost
        )


@dataclass
class Usage:
    groups: dict[str | None, Tally] = field(default_factory=dict)
    total: Tally = field(default_factory=Tally)

    def by_cost(self) -> list[tuple[str | None, Tally]]:
        """Groups by cost, highest first (ties: by key, null last), for a stable answer."""
        return sorted(self.groups.items(), key=lambda kv: (-kv[1].cost, kv[0] is None, kv[0] or ""))


async def usage(
    backend: Backend,
    group_by: GroupBy,
    *,
    since: int,
    until: int,
    now: int,
    pool_owner: str | None = None,
) -> Usage:
    """What leases held during [since, until) cost, per `group_by`: of each lease the
    part of its held time inside the period; a live one's up to `now`. With `pool_owner`,
    the warm pools' workers too, each from its start in the pool until its claim (or its
    end), under that owner when grouped by owner."""
    rows = await backend.read(_held_rows, group_by, since, until, pool_owner)
    return tally(rows, since=since, until=min(until, now))


def tally(
    rows: Iterable[tuple[str | None, float | None, int, int | None]], *, since: int, until: int
) -> Usage:
    found = Usage()
    for key, price, granted_at, released_at in rows:
        held = held_us(granted_at, released_at, since, until)
        live = released_at is None
        # Overlapping the period: held inside it (a lease granted at the very end of a
        # period that is now counts, for nothing yet).
        if held <= 0 and not (live and granted_at <= until):
            continue
        found.groups.setdefault(key, Tally()).add(live, held, price)
        found.total.add(live, held, price)
    return found


async def purge_ended(
    backend: Backend, ended: Sequence[LeaseState], *, before: int, batch: int = PURGE_BATCH
) -> int:
    """Delete the leases in `ended` (StateSets.ended) whose `released_at` is before
    `before`, a batch per transaction; how many went. Any number of replicas may run it
    at once: a row deleted twice is deleted once."""
    purge = _purge(tuple(ended))
    purged = 0
    while True:
        gone = await backend.write(_purge_batch, purge, before, batch)
        purged += gone
        if gone < batch:
            return purged


# Only the columns usage needs, of the leases whose held time may overlap the period.
_HELD = {
    group: select(column, leases.c.price_per_hour, leases.c.granted_at, leases.c.released_at).where(
        leases.c.granted_at.is_not(None),
        leases.c.granted_at < bindparam("b_until"),
        leases.c.released_at.is_(None) | (leases.c.released_at > bindparam("b_since")),
    )
    for group, column in _GROUP_COLUMN.items()
}


# A pool worker's time in the pool ends at its claim (the row's `created_at` becomes the
# claim's time, and `requested_at` is set), else with the worker.
_pool_end = case(
    (leases.c.requested_at.is_not(None), leases.c.created_at), else_=leases.c.released_at
)
_POOLED = {
    group: select(column, leases.c.price_per_hour, leases.c.pooled_at, _pool_end).where(
        leases.c.pooled_at.is_not(None),
        leases.c.pooled_at < bindparam("b_until"),
        _pool_end.is_(None) | (_pool_end > bindparam("b_since")),
    )
    for group, column in _GROUP_COLUMN.items()
}


def _held_rows(
    conn: Connection, group_by: GroupBy, since: int, until: int, pool_owner: str | None
) -> list[tuple[str | None, float | None, int, int | None]]:
    period = {"b_since": since, "b_until": until}
    rows: list[tuple[str | None, float | None, int, int | None]] = [
        (key, price, granted, released)
        for key, price, granted, released in conn.execute(_HELD[group_by], period)
    ]
    if pool_owner is not None:
        for key, price, start, end in conn.execute(_POOLED[group_by], period):
            rows.append((pool_owner if group_by == "owner" else key, price, start, end))
    return rows


@functools.cache
def _purge(ended: tuple[LeaseState, ...]) -> Any:
    old_ended = (
        select(leases.c.lease_id)
        .where(state_in(ended), leases.c.released_at < bindparam("b_before"))
        .limit(bindparam("b_batch"))
    )
    return delete(leases).where(leases.c.lease_id.in_(old_ended.scalar_subquery()))


def _purge_batch(conn: Connection, purge: Any, before: int, batch: int) -> int:
    # The state is checked again by the DELETE's own subquery, in its transaction: a row
    # is only ever removed once ended.
    return int(conn.execute(purge, {"b_before": before, "b_batch": batch}).rowcount or 0)
