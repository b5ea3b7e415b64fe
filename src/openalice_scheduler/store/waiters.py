"""The callers waiting in line for capacity, on every replica (`waiters`, migration
0011): each replica writes its own waiters in and out; a reservation's admission reads
those ahead of it (store/reserving.py) so that the line is one, in order of priority
then arrival. Which caller is ahead, and whether it could use the capacity, is the
core's (lifecycle/admission.py)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.engine import Connection

from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.schema import leases, replicas, waiters


@dataclass(frozen=True, slots=True)
class WaitingRow:
    """One caller in line, as the store keeps it."""

    waiter_id: str
    priority: int
    arrived_at: int
    kind: str
    gpu: str
    region: str | None
    owner_id: str | None = None
    correlation_id: str | None = None
    priority_class: str = "default"
    # The providers that could serve its request (its kind, GPU class, region).
    providers: tuple[str, ...] = ()
    until: int = 0
    # The lease it preempted, whose capacity is its alone once freed.
    claims: str | None = None


class Waiters:
    def __init__(self, backend: Backend, replica_id: str) -> None:
        self.backend = backend
        self.replica_id = replica_id

    async def enter(self, row: WaitingRow) -> None:
        """Its row, written (a preemption may have written it already, with its claim:
        then only its place is brought up to date)."""

        def _tx(conn: Connection) -> None:
            enter(conn, self.replica_id, row)

        await self.backend.write(_tx)

    async def leave(self, waiter_id: str) -> None:
        await self.backend.write(
            lambda conn: conn.execute(delete(waiters).where(waiters.c.waiter_id == waiter_id))
        )

    async def forget_all(self) -> None:
        """Every row (a store this process alone uses, at its start: its callers left
        with the process before it)."""
        await self.backend.write(lambda conn: conn.execute(delete(waiters)))


def enter(conn: Connection, replica_id: str, row: WaitingRow) -> None:
    """`row` into the line, or its place brought up to date (its claim kept). A row of
    the same request (owner and correlation id) left by a caller that is gone (its
    replica killed, its connection lost) is replaced: a retry waits once, with its
    claim."""
    if row.owner_id is not None and row.correlation_id is not None:
        conn.execute(
            delete(waiters).where(
                waiters.c.owner_id == row.owner_id,
                waiters.c.correlation_id == row.correlation_id,
                waiters.c.waiter_id != row.waiter_id,
            )
        )
    values = {
        "replica_id": replica_id,
        "owner_id": row.owner_id,
        "correlation_id": row.correlation_id,
        "priority_class": row.priority_class,
        "priority": row.priority,
        "arrived_at": row.arrived_at,
        "kind": row.kind,
        "gpu": row.gpu,
        "region": row.region,
        "providers": "," + ",".join(row.providers) + ",",
        "until": row.until,
    }
    if row.claims is not None:
        values["claims"] = row.claims
    found = conn.execute(
        update(waiters).where(waiters.c.waiter_id == row.waiter_id).values(**values)
    )
    if found.rowcount == 0:
        conn.execute(waiters.insert().values(waiter_id=row.waiter_id, **values))


def ahead_of(
    conn: Connection,
    *,
    priority: int,
    arrived_at: int,
    exclude: str,
    provider: str,
    alive_since: int,
    now: int,
) -> list[WaitingRow]:
    """The callers ahead of (`priority`, `arrived_at`) whose request `provider` could
    serve, still waiting on a replica alive since `alive_since`, first first; before
    them, whatever their place, those that preempted a lease of `provider`: its
    capacity is theirs."""
    rows = conn.execute(
        _AHEAD,
        {
            "b_priority": priority,
            "b_arrived": arrived_at,
            "b_exclude": exclude,
            "b_provider": f"%,{provider},%",
            "b_provider_name": provider,
            "b_alive": alive_since,
            "b_now": now,
        },
    )
    # By position: rows come as SQLAlchemy rows or asyncpg records (store/pg_tx.py).
    return [WaitingRow(*r[:9], tuple(p for p in r[9].split(",") if p), *r[10:]) for r in rows]


_CLAIMS_HERE = waiters.c.claims.in_(
    select(leases.c.lease_id).where(leases.c.provider == bindparam("b_provider_name"))
)
# In WaitingRow's order.
_ROW = (
    waiters.c.waiter_id,
    waiters.c.priority,
    waiters.c.arrived_at,
    waiters.c.kind,
    waiters.c.gpu,
    waiters.c.region,
    waiters.c.owner_id,
    waiters.c.correlation_id,
    waiters.c.priority_class,
    waiters.c.providers,
    waiters.c.until,
    waiters.c.claims,
)
_AHEAD = (
    select(*_ROW)
    .join(replicas, replicas.c.replica_id == waiters.c.replica_id)
    .where(
        (
            waiters.c.providers.like(bindparam("b_provider"))
            & (
                (waiters.c.priority > bindparam("b_priority"))
                | (
                    (waiters.c.priority == bindparam("b_priority"))
                    & (waiters.c.arrived_at < bindparam("b_arrived"))
                )
            )
        )
        | _CLAIMS_HERE,
        waiters.c.waiter_id != bindparam("b_exclude"),
        waiters.c.until > bindparam("b_now"),
        replicas.c.heartbeat_at >= bindparam("b_alive"),
    )
    .order_by(waiters.c.claims.is_(None), waiters.c.priority.desc(), waiters.c.arrived_at)
)
