"""The callers waiting in line for capacity, on every replica (`waiters`, migration
0013). Each replica writes its own callers in; the admission loop (on the leader,
lifecycle/admitting.py) reads the whole line at once and writes its decision on a row
as one guarded update, in the same transaction as the lease it grants; the caller's
replica reads the decisions on its rows and takes its caller back out. Who is admitted,
in what order, and on what terms is the core's; the store reads and writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, delete, exists, select, update
from sqlalchemy.engine import Connection

from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.schema import replicas, waiters

# A row's arrival is kept this long after its caller left (its wait ran out): the same
# request (owner and correlation id) asking again keeps its place (docs: aging).
KEEP_ARRIVAL_US = 600_000_000
# A row whose wait is over is deleted this long after (its caller takes it back first).
PURGE_AFTER_US = 60_000_000


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
    # The providers that may serve its request, in the policy's order.
    providers: tuple[str, ...] = ()
    until: int = 0
    lease_id: str = ""
    ttl_seconds: int = 60
    patient: bool = True
    pooled: bool = False
    replica_id: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    """The admission loop's word on a caller: the lease `granted` (its id), or the
    `refusal` (JSON the core wrote)."""

    waiter_id: str
    granted: str | None
    refusal: str | None


class Waiters:
    def __init__(self, backend: Backend, replica_id: str) -> None:
        self.backend = backend
        self.replica_id = replica_id

    async def enter(self, row: WaitingRow) -> int:
        """Its row, written; the arrival it is given: its own, or that of the same
        request (owner and correlation id) that waited before and left (its wait ran
        out, its replica died) within KEEP_ARRIVAL_US. That row is replaced."""

        def _tx(conn: Connection) -> int:
            arrived = row.arrived_at
            if row.owner_id is not None and row.correlation_id is not None:
                same = (
                    waiters.c.owner_id == row.owner_id,
                    waiters.c.correlation_id == row.correlation_id,
                    waiters.c.granted.is_(None),
                    waiters.c.refusal.is_(None),
                )
                earlier = conn.execute(select(waiters.c.arrived_at).where(*same)).scalars().all()
                kept = [a for a in earlier if a >= row.arrived_at - KEEP_ARRIVAL_US]
                arrived = min([arrived, *kept])
                conn.execute(delete(waiters).where(*same))
            conn.execute(
                waiters.insert().values(
                    waiter_id=row.waiter_id,
                    replica_id=self.replica_id,
                    owner_id=row.owner_id,
                    correlation_id=row.correlation_id,
                    priority_class=row.priority_class,
                    priority=row.priority,
                    arrived_at=arrived,
                    kind=row.kind,
                    gpu=row.gpu,
                    region=row.region,
                    providers=",".join(row.providers),
                    until=row.until,
                    lease_id=row.lease_id,
                    ttl_seconds=row.ttl_seconds,
                    patient=row.patient,
                    pooled=row.pooled,
                )
            )
            return arrived

        return await self.backend.write(_tx)

    async def retarget(self, waiter_id: str, lease_id: str, providers: tuple[str, ...]) -> None:
        """A caller whose granted provision failed asks again: a new lease id, the
        providers left; its place kept."""
        await self.backend.write(
            lambda conn: conn.execute(
                update(waiters)
                .where(waiters.c.waiter_id == waiter_id)
                .values(
                    lease_id=lease_id,
                    providers=",".join(providers),
                    granted=None,
                    refusal=None,
                    decided_at=None,
                )
            )
        )

    async def take_back(self, waiter_id: str, *, keep_until: int | None = None) -> Decision | None:
        """The caller leaves the line: its row, if still undecided, is deleted (or,
        with `keep_until`, kept undecided-and-out so that a retry keeps its arrival),
        and None is returned; a decided row's decision is returned (the caller must
        honour it: a lease granted at the moment it gave up is its)."""

        def _tx(conn: Connection) -> Decision | None:
            found = conn.execute(
                select(waiters.c.granted, waiters.c.refusal).where(waiters.c.waiter_id == waiter_id)
            ).first()
            if found is None:
                return None
            granted, refusal = found[0], found[1]
            if granted is not None or refusal is not None:
                conn.execute(delete(waiters).where(waiters.c.waiter_id == waiter_id))
                return Decision(waiter_id, granted, refusal)
            if keep_until is not None:
                # Out of line, its arrival remembered until then.
                conn.execute(
                    update(waiters)
                    .where(waiters.c.waiter_id == waiter_id)
                    .values(left_until=keep_until)
                )
            else:
                conn.execute(delete(waiters).where(waiters.c.waiter_id == waiter_id))
            return None

        return await self.backend.write(_tx)

    async def line(self, *, alive_since: int, now: int) -> list[WaitingRow]:
        """Every caller waiting, undecided, on a replica heard from since
        `alive_since`, whose wait is not over: the whole line, in no order."""

        def _tx(conn: Connection) -> list[WaitingRow]:
            found = {"b_alive": alive_since, "b_now": now, "b_me": self.replica_id}
            rows = conn.execute(_LINE, found)
            return [_row(r) for r in rows]

        return await self.backend.read(_tx)

    async def decided(self) -> list[Decision]:
        """The decisions on this replica's callers."""

        def _tx(conn: Connection) -> list[Decision]:
            rows = conn.execute(_DECIDED, {"b_replica": self.replica_id})
            return [Decision(r[0], r[1], r[2]) for r in rows]

        return await self.backend.read(_tx)

    async def granted(self) -> set[str]:
        """The leases granted to callers who have not taken their decision yet."""

        def _tx(conn: Connection) -> set[str]:
            rows = conn.execute(select(waiters.c.granted).where(waiters.c.granted.is_not(None)))
            return set(rows.scalars())

        return await self.backend.read(_tx)

    async def unclaimed(self, *, alive_since: int) -> list[Decision]:
        """Rooms granted before `alive_since` to callers of other replicas not heard from
        since, and never taken back: their callers went with their replica."""

        def _tx(conn: Connection) -> list[Decision]:
            found = {"b_alive": alive_since, "b_me": self.replica_id}
            return [Decision(r[0], r[1], r[2]) for r in conn.execute(_UNCLAIMED, found)]

        return await self.backend.read(_tx)

    async def refuse(self, waiter_id: str, refusal: str, *, now: int) -> bool:
        """The loop's refusal of an undecided caller (guarded)."""
        return await self.backend.write(lambda conn: decide(conn, waiter_id, None, refusal, now))

    async def forget_all(self) -> None:
        """Every row (a store this process alone uses, at its start: its callers left
        with the process before it)."""
        await self.backend.write(lambda conn: conn.execute(delete(waiters)))

    async def forget_mine(self) -> None:
        """This replica's rows (it starts again under the same id)."""
        await self.backend.write(
            lambda conn: conn.execute(
                delete(waiters).where(waiters.c.replica_id == self.replica_id)
            )
        )


def decide(
    conn: Connection, waiter_id: str, granted: str | None, refusal: str | None, now: int
) -> bool:
    """The decision on an undecided caller still in line, in the caller's transaction:
    False when it left (or was decided) meanwhile."""
    done = conn.execute(
        update(waiters)
        .where(
            waiters.c.waiter_id == waiter_id,
            waiters.c.granted.is_(None),
            waiters.c.refusal.is_(None),
            waiters.c.left_until.is_(None),
        )
        .values(granted=granted, refusal=refusal, decided_at=now)
    )
    return bool(done.rowcount)


def purge(conn: Connection, now: int) -> None:
    """Rows nobody will take back: a wait over a minute ago (its replica stopped while
    it waited), an arrival no longer kept."""
    conn.execute(
        delete(waiters).where(
            (waiters.c.left_until.is_(None) & (waiters.c.until < now - PURGE_AFTER_US))
            | (waiters.c.left_until < now)
        )
    )


def someone_waits(conn: Connection, replica_id: str, *, alive_since: int, now: int) -> bool:
    """Whether any caller waits in line, undecided, on this replica or another alive
    since `alive_since`."""
    found = {"b_alive": alive_since, "b_now": now, "b_me": replica_id}
    return bool(conn.execute(_ANYONE, found).scalar())


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
    waiters.c.lease_id,
    waiters.c.ttl_seconds,
    waiters.c.patient,
    waiters.c.pooled,
    waiters.c.replica_id,
)


def _row(r: Any) -> WaitingRow:
    # By position: rows come as SQLAlchemy rows or asyncpg records (store/pg_tx.py).
    return WaitingRow(
        waiter_id=r[0],
        priority=r[1],
        arrived_at=r[2],
        kind=r[3],
        gpu=r[4],
        region=r[5],
        owner_id=r[6],
        correlation_id=r[7],
        priority_class=r[8],
        providers=tuple(p for p in str(r[9]).split(",") if p),
        until=r[10],
        lease_id=r[11],
        ttl_seconds=r[12],
        patient=bool(r[13]),
        pooled=bool(r[14]),
        replica_id=r[15],
    )


_WAITING = (
    waiters.c.left_until.is_(None),
    waiters.c.granted.is_(None),
    waiters.c.refusal.is_(None),
    waiters.c.until > bindparam("b_now"),
    # Callers of replicas heard from lately, and this replica's own.
    (replicas.c.heartbeat_at >= bindparam("b_alive")) | (waiters.c.replica_id == bindparam("b_me")),
)
_ALIVE = replicas.c.replica_id == waiters.c.replica_id
_LINE = select(*_ROW).outerjoin(replicas, _ALIVE).where(*_WAITING)
_ANYONE = select(exists(select(waiters.c.waiter_id).outerjoin(replicas, _ALIVE).where(*_WAITING)))
_DECIDED = select(waiters.c.waiter_id, waiters.c.granted, waiters.c.refusal).where(
    waiters.c.replica_id == bindparam("b_replica"), waiters.c.decided_at.is_not(None)
)
_UNCLAIMED = (
    select(waiters.c.waiter_id, waiters.c.granted, waiters.c.refusal)
    .outerjoin(replicas, _ALIVE)
    .where(
        waiters.c.granted.is_not(None),
        waiters.c.decided_at < bindparam("b_alive"),
        waiters.c.replica_id != bindparam("b_me"),
        replicas.c.heartbeat_at.is_(None) | (replicas.c.heartbeat_at < bindparam("b_alive")),
    )
)
