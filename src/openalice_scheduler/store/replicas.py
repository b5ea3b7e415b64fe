"""The scheduler processes sharing a store: their heartbeats, and named locks with an
expiry that one replica holds at a time (reconciliation)."""

from __future__ import annotations

from sqlalchemy import select, true, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement

from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.schema import locks, replicas
from openalice_scheduler.store.waiters import purge

_DAY_US = 86_400_000_000


class Replicas:
    def __init__(self, backend: Backend, replica_id: str) -> None:
        self.backend = backend
        self.replica_id = replica_id

    async def heartbeat(self, *, now: int) -> None:
        """Record that this replica is alive; forget replicas silent for a day. On a
        connection of its own (`write_apart`): a burst holding every other connection
        must not make this replica look dead."""

        def _tx(conn: Connection) -> None:
            beat = update(replicas).where(replicas.c.replica_id == self.replica_id)
            if conn.execute(beat.values(heartbeat_at=now)).rowcount == 0:
                conn.execute(
                    replicas.insert().values(
                        replica_id=self.replica_id, started_at=now, heartbeat_at=now
                    )
                )
            conn.execute(replicas.delete().where(replicas.c.heartbeat_at < now - _DAY_US))
            # Callers whose wait is over (their replica stopped while they waited).
            purge(conn, now)

        await self.backend.write_apart(_tx)

    async def alive(self, *, since: int) -> set[str]:
        """Replicas with a heartbeat at or after `since`; this one always counts. In a
        store this process alone uses, no other replica can be alive."""
        if self.backend.exclusive:
            return {self.replica_id}

        def _tx(conn: Connection) -> set[str]:
            rows = conn.execute(
                select(replicas.c.replica_id).where(replicas.c.heartbeat_at >= since)
            )
            return set(rows.scalars())

        return await self.backend.read(_tx) | {self.replica_id}

    async def try_lock(
        self, name: str, *, ttl_us: int, now: int, holder_gone_before: int | None = None
    ) -> bool:
        """Take (or keep) the named lock for `ttl_us`; False while another replica holds
        it. With `holder_gone_before`, a lock whose holder has not heartbeated since
        then is taken over at once."""

        def _tx(conn: Connection) -> bool:
            free: ColumnElement[bool] = (locks.c.holder == self.replica_id) | (
                locks.c.expires_at < now
            )
            if self.backend.exclusive:
                # Nobody else uses this store: a lock another replica id holds is a
                # process that is gone (killed in the middle of a pass), and a restart
                # must not wait out its TTL before it reconciles.
                free = true()
            elif holder_gone_before is not None:
                # A replica killed in the middle of a pass (kill -9) holds the lock until
                # its TTL runs out: without this, nobody reconciles meanwhile.
                free = free | locks.c.holder.not_in(
                    select(replicas.c.replica_id).where(
                        replicas.c.heartbeat_at >= holder_gone_before
                    )
                )
            taken = conn.execute(
                update(locks)
                .where(locks.c.name == name, free)
                .values(holder=self.replica_id, expires_at=now + ttl_us)
            )
            if taken.rowcount:
                return True
            try:
                with conn.begin_nested():
                    conn.execute(
                        locks.insert().values(
                            name=name, holder=self.replica_id, expires_at=now + ttl_us
                        )
                    )
            except IntegrityError:
                return False  # held by another replica
            return True

        return await self.backend.write(_tx)

    async def unlock(self, name: str) -> None:
        def _tx(conn: Connection) -> None:
            conn.execute(
                locks.delete().where(locks.c.name == name, locks.c.holder == self.replica_id)
            )

        await self.backend.write(_tx)
