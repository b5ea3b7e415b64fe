"""What the guards (`openalice-scheduler guard`, guard/) read and leave in the store:
each poll records the guard's contact, and reads the deadline of every live worker. The
rows are bounded: a new guard is recorded only while there is room (MAX_GUARDS), and
guards silent too long are forgotten (GUARD_FORGET_SECONDS, retention.py's loop)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select, update
from sqlalchemy.engine import Connection

from openalice_scheduler.models import LeaseState
from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.schema import guards, leases

_WORKERS = select(
    leases.c.lease_id, leases.c.provider, leases.c.state, leases.c.expires_at, leases.c.released_at
)
_ROOM = select(func.count(), func.min(guards.c.last_contact_at)).select_from(guards)
# Taken by a new guard's transaction only: on PostgreSQL two replicas recording two new
# guards at once could otherwise both take the last room (SQLite has one writer anyway).
_NEW_GUARD_LOCK = "guards:new"


@dataclass(frozen=True, slots=True)
class GuardContact:
    guard_id: str
    providers: tuple[str, ...]
    last_contact_at: int  # µs since the epoch


@dataclass(frozen=True, slots=True)
class LiveWorker:
    """A live lease row as a guard needs it: until when its worker may run."""

    lease_id: str
    provider: str
    state: str
    expires_at: int
    released_at: int | None


class GuardsFull(Exception):
    """A new guard polled, and `known` guards are recorded already: no room left.
    `oldest_contact_at`: the longest silent one's last contact (µs)."""

    def __init__(self, known: int, oldest_contact_at: int) -> None:
        super().__init__(f"{known} guards recorded")
        self.known = known
        self.oldest_contact_at = oldest_contact_at


class GuardStore:
    def __init__(self, backend: Backend, live: Sequence[LeaseState]) -> None:
        """`live`: the states whose workers a guard watches (StateSets.holds_capacity)."""
        self.backend = backend
        self._live = _WORKERS.where(leases.c.state.in_([s.value for s in live]))

    async def contact(
        self,
        guard_id: str,
        providers: tuple[str, ...],
        *,
        now: int,
        most: int,
        forget_before: int,
    ) -> None:
        """Record a guard's poll. A guard not recorded yet is recorded only while fewer
        than `most` are (those silent since before `forget_before` forgotten first);
        else GuardsFull, and nothing is written."""
        watched = ",".join(providers)
        seen = (
            update(guards)
            .where(guards.c.guard_id == guard_id)
            .values(providers=watched, last_contact_at=now)
        )

        def _tx(conn: Connection) -> None:
            if conn.execute(seen).rowcount:
                return  # a known guard: every poll but its first
            self.backend.lock(conn, _NEW_GUARD_LOCK)
            if conn.execute(seen).rowcount:
                return  # recorded by another replica meanwhile
            conn.execute(guards.delete().where(guards.c.last_contact_at < forget_before))
            known, oldest = conn.execute(_ROOM).one()
            if known >= most:
                raise GuardsFull(known, oldest)
            conn.execute(
                guards.insert().values(guard_id=guard_id, providers=watched, last_contact_at=now)
            )

        await self.backend.write(_tx)

    async def forget(self, *, before: int) -> int:
        """Forget the guards whose last contact is older than `before`; how many."""

        def _tx(conn: Connection) -> int:
            gone = conn.execute(guards.delete().where(guards.c.last_contact_at < before))
            return int(gone.rowcount)

        return await self.backend.write(_tx)

    async def contacts(self) -> list[GuardContact]:
        def _tx(conn: Connection) -> list[GuardContact]:
            rows = conn.execute(select(guards).order_by(guards.c.guard_id))
            return [
                # Each provider once: rows written before polls were checked may repeat one.
                GuardContact(
                    r.guard_id,
                    tuple(dict.fromkeys(p for p in r.providers.split(",") if p)),
                    r.last_contact_at,
                )
                for r in rows
            ]

        return await self.backend.read(_tx)

    async def live(self, providers: tuple[str, ...]) -> list[LiveWorker]:
        """The live rows of `providers`."""
        query = self._live.where(leases.c.provider.in_(providers))

        def _tx(conn: Connection) -> list[LiveWorker]:
            return [LiveWorker(*row) for row in conn.execute(query)]

        return await self.backend.read(_tx)
