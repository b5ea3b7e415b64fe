"""The lease path's statements, shared by the lease store (leases.py) and the pool's
transactions (pool.py), and the one guarded update every state change goes through.

They are built once: each execution then only binds its values (SQLAlchemy's compiled
cache keeps their SQL), instead of building the statement, coercing every value and
making its cache key anew. Those that select by a set of states (which leases answer a
request, count against a quota...) take the set from the core: built once for the sets
the store is opened with (`lease_statements`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, case, func, literal_column, select, update
from sqlalchemy.engine import Connection

from openalice_scheduler.models import LeaseState, ReleaseReason
from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.records import LeaseRecord, Move, StateSets, record_of
from openalice_scheduler.store.schema import leases
from openalice_scheduler.times import HOUR_US


def state_in(states: Sequence[str]) -> Any:
    """`state IN ('a', 'b')` with the states (enum values, never caller input) written
    into the SQL: no list parameter to expand at each execution."""
    return leases.c.state.in_([literal_column(f"'{LeaseState(s).value}'") for s in states])


def released(move: Move, now: int, reason: ReleaseReason | None) -> dict[str, Any]:
    """The columns of a lease ended by `move` (its reason kept when None)."""
    values: dict[str, Any] = {
        "state": move.target.value,
        "released_at": now,
        "next_attempt_at": None,
        "updated_at": now,
    }
    if reason is not None:
        values["release_reason"] = reason.value
    return values


def transition_tx(
    conn: Connection,
    lease_id: str,
    expected: Sequence[LeaseState],
    values: dict[str, Any],
    frees: Backend | None = None,
) -> LeaseRecord | None:
    """Guarded update of one lease; None when it was in none of `expected`. `frees`:
    the lease stops holding capacity, which that backend announces to other replicas.
    An update that ends the lease (sets `released_at`) also sets its `cost`."""
    columns = tuple(sorted(values))
    statement = _update(tuple(s.value for s in expected), columns)
    row = conn.execute(
        statement, {"b_id": lease_id, **{f"v_{name}": values[name] for name in columns}}
    ).first()
    if row is not None and frees is not None:
        frees.announce_freed(conn)
    return record_of(row) if row else None


def cost_at(released_at: Any) -> Any:
    """What a lease costs when it ends at `released_at`: its price × the time from its
    grant, in USD; 0 when it was never granted, null when its price is unknown."""
    return case(
        (leases.c.granted_at.is_(None), 0.0),
        else_=leases.c.price_per_hour * (released_at - leases.c.granted_at) / float(HOUR_US),
    )


@functools.cache
def _update(expected: tuple[str, ...], columns: tuple[str, ...]) -> Any:
    """The guarded update of `columns` of a lease in one of `expected`."""
    values: dict[str, Any] = {name: bindparam(f"v_{name}") for name in columns}
    if "released_at" in columns:
        values["cost"] = cost_at(bindparam("v_released_at"))
    return (
        update(leases)
        .where(leases.c.lease_id == bindparam("b_id"), state_in(expected))
        .values(values)
        .returning(*leases.c)
    )


OTHERS = leases.c.lease_id != bindparam("b_id")
GET = select(leases).where(leases.c.lease_id == bindparam("b_id"))
INSERT = leases.insert().returning(*leases.c)
# An owner's money (spending.py): the leases that may have cost it something since
# `b_since`.
OWNER_SPENDING = select(leases.c.price_per_hour, leases.c.granted_at, leases.c.released_at).where(
    leases.c.owner_id == bindparam("b_owner"),
    leases.c.price_per_hour > 0,
    leases.c.granted_at.is_not(None),
    (leases.c.released_at.is_(None)) | (leases.c.released_at > bindparam("b_since")),
)


@dataclass(frozen=True, slots=True)
class LeaseStatements:
    """The lease path's statements that select by the core's sets of states, built once
    for the sets the store was opened with (`lease_statements`)."""

    # Another lease answering the same request (owner_id, correlation_id); the lease
    # answering it.
    twin: Any
    request: Any
    # The leases counting against an owner's quota, this one left out.
    held_by_owner: Any
    # The leases holding a provider's capacity, and the resources they hold.
    count_live: Any
    taken: Any
    # USD per hour of what an owner pays for now (spending.py).
    owner_price: Any
    # Pool workers (warming or idle) of a kind and GPU class; the one idle longest.
    count_pool: Any
    oldest_idle: Any


@functools.cache
def lease_statements(states: StateSets) -> LeaseStatements:
    this_pool = (leases.c.kind == bindparam("b_kind"), leases.c.gpu == bindparam("b_gpu"))
    live_here = (
        leases.c.provider == bindparam("b_provider"),
        state_in(states.holds_capacity),
        OTHERS,
    )
    return LeaseStatements(
        twin=select(leases.c.lease_id).where(
            leases.c.owner_id == bindparam("b_owner"),
            leases.c.correlation_id == bindparam("b_corr"),
            state_in(states.answered),
            OTHERS,
        ),
        request=select(leases).where(
            leases.c.owner_id == bindparam("b_owner"),
            leases.c.correlation_id == bindparam("b_corr"),
            state_in(states.answered),
        ),
        held_by_owner=select(func.count())
        .select_from(leases)
        .where(leases.c.owner_id == bindparam("b_owner"), state_in(states.held), OTHERS),
        count_live=select(func.count()).select_from(leases).where(*live_here),
        taken=select(leases.c.resource).where(*live_here, leases.c.resource.is_not(None)),
        owner_price=select(func.coalesce(func.sum(leases.c.price_per_hour), 0.0)).where(
            leases.c.owner_id == bindparam("b_owner"), state_in(states.paid), OTHERS
        ),
        count_pool=select(func.count())
        .select_from(leases)
        .where(state_in(states.pooled), *this_pool),
        # A pool worker serves only requests without a region: it was made for none.
        # Locked: concurrent claims on PostgreSQL each lock a different one (SKIP LOCKED).
        oldest_idle=select(leases.c.lease_id, leases.c.provider, leases.c.price_per_hour)
        .where(state_in(states.idle), *this_pool, leases.c.region.is_(None))
        .order_by(leases.c.updated_at)
        .limit(1)
        .with_for_update(skip_locked=True),
    )
