"""What the guards (`openalice-scheduler guard`, guard/) read and leave in the store:
each poll records the guard's contact, and reads the deadline of every live worker."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.engine import Connection

from openalice_scheduler.models import LIVE_STATES
from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.schema import guards, leases

_DAY_US = 86_400_000_000
_LIVE = select(
    leases.c.lease_id, leases.c.provider, leases.c.state, leases.c.expires_at, leases.c.released_at
).where(leases.c.state.in_([s.value for s in LIVE_STATES]))


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


class GuardStore:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def contact(self, guard_id: str, providers: tuple[str, ...], *, now: int) -> None:
        """Record a guard's poll; forget guards silent for a day (a guard taken down)."""
        watched = ",".join(providers)

        def _tx(conn: Connection) -> None:
            seen = update(guards).where(guards.c.guard_id == guard_id)
            if conn.execute(seen.values(providers=watched, last_contact_at=now)).rowcount == 0:
                conn.execute(
                    guards.insert().values(
                        guard_id=guard_id, providers=watched, last_contact_at=now
                    )
                )
            conn.execute(guards.delete().where(guards.c.last_contact_at < now - _DAY_US))

        await self.backend.write(_tx)

    async def contacts(self) -> list[GuardContact]:
        def _tx(conn: Connection) -> list[GuardContact]:
            rows = conn.execute(select(guards).order_by(guards.c.guard_id))
            return [
                GuardContact(
                    r.guard_id, tuple(p for p in r.providers.split(",") if p), r.last_contact_at
                )
                for r in rows
            ]

        return await self.backend.read(_tx)

    async def live(self, providers: tuple[str, ...]) -> list[LiveWorker]:
        """The live rows of `providers`."""
        query = _LIVE.where(leases.c.provider.in_(providers))

        def _tx(conn: Connection) -> list[LiveWorker]:
            return [LiveWorker(*row) for row in conn.execute(query)]

        return await self.backend.read(_tx)
