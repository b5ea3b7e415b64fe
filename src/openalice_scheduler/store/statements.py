"""The lease path's statements, shared by the lease store (leases.py) and the pool's
transactions (pool.py), and the one guarded update every state change goes through.

They are built once: each execution then only binds its values (SQLAlchemy's compiled
cache keeps their SQL), instead of building the statement, coercing every value and
making its cache key anew."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, case, func, literal_column, select, update
from sqlalchemy.engine import Connection

from openalice_scheduler.models import LIVE_STATES, LeaseState, ReleaseReason
from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.records import LeaseRecord, Move, record_of
from openalice_scheduler.store.schema import leases
from openalice_scheduler.times import HOUR_US

LIVE = [s.value for s in LIVE_STATES]
# What answers an idempotent replay (schema.IDEMPOTENCY_SCOPE), and what counts
# against an owner's quota: those and a lease being preempted, whose worker still runs.
ANSWERED = [LeaseState.provisioning.value, LeaseState.active.value]
HELD = [*ANSWERED, LeaseState.preempting.value]
# What an owner pays for now: held leases, and those whose worker is being destroyed.
PAID = [*HELD, LeaseState.releasing.value]


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
TWIN = select(leases.c.lease_id).where(
    leases.c.owner_id == bindparam("b_owner"),
    leases.c.correlation_id == bindparam("b_corr"),
    state_in(ANSWERED),
    OTHERS,
)
REQUEST = select(leases).where(
    leases.c.owner_id == bindparam("b_owner"),
    leases.c.correlation_id == bindparam("b_corr"),
    state_in(ANSWERED),
)
HELD_BY_OWNER = (
    select(func.count())
    .select_from(leases)
    .where(leases.c.owner_id == bindparam("b_owner"), state_in(HELD), OTHERS)
)
_LIVE_HERE = (leases.c.provider == bindparam("b_provider"), state_in(LIVE), OTHERS)
COUNT_LIVE = select(func.count()).select_from(leases).where(*_LIVE_HERE)
TAKEN = select(leases.c.resource).where(*_LIVE_HERE, leases.c.resource.is_not(None))
INSERT = leases.insert().returning(*leases.c)
# An owner's money (store/budgets.py): the price per hour of what it pays for now, and
# the leases that may have cost it something since `b_since`.
OWNER_PRICE = select(func.coalesce(func.sum(leases.c.price_per_hour), 0.0)).where(
    leases.c.owner_id == bindparam("b_owner"), state_in(PAID), OTHERS
)
OWNER_SPENDING = select(leases.c.price_per_hour, leases.c.granted_at, leases.c.released_at).where(
    leases.c.owner_id == bindparam("b_owner"),
    leases.c.price_per_hour > 0,
    leases.c.granted_at.is_not(None),
    (leases.c.released_at.is_(None)) | (leases.c.released_at > bindparam("b_since")),
)
