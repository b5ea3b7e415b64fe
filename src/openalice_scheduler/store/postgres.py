"""PostgreSQL: several replicas on one database, through SQLAlchemy's async engine on
asyncpg. Transactions that must not interleave across replicas take advisory locks;
freed capacity is announced with NOTIFY and heard with LISTEN."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import text
from sqlalchemy.engine import URL, Connection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from openalice_scheduler.store.backend import guarded

log = logging.getLogger(__name__)
T = TypeVar("T")

# The channel on which replicas announce freed capacity to each other's waiters.
CAPACITY_CHANNEL = "openalice_capacity"


class PostgresBackend:
    name = "postgresql"
    exclusive = False
    path: Path | None = None

    def __init__(self, url: URL) -> None:
        self.url = url
        self.engine: AsyncEngine = create_async_engine(
            url.set(drivername="postgresql+asyncpg"), pool_pre_ping=True, pool_size=10,
            max_overflow=20,
        )

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        return await guarded(self._write(fn, args))

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        return await guarded(self._read(fn, args))

    def lock(self, conn: Connection, key: str) -> None:
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _lock_id(key)})

    def announce_freed(self, conn: Connection) -> None:
        conn.execute(text(f"NOTIFY {CAPACITY_CHANNEL}"))  # delivered on commit

    async def listen_freed(self, callback: Callable[[], None]) -> None:
        """LISTEN until cancelled, connecting again after an outage."""
        import asyncpg

        dsn = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while True:
            try:
                conn = await asyncpg.connect(dsn)
            except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
                log.debug("LISTEN: cannot connect (%s); retrying", type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            lost = asyncio.Event()
            conn.add_termination_listener(lambda _c, done=lost: done.set())
            try:
                await conn.add_listener(CAPACITY_CHANNEL, lambda *_args: callback())
                callback()  # capacity may have been freed while nobody listened
                await lost.wait()
            except (OSError, asyncpg.PostgresError):
                pass
            finally:
                if not conn.is_closed():
                    await conn.close(timeout=2)
            await asyncio.sleep(0.5)

    async def close(self) -> None:
        await self.engine.dispose()

    async def _write(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        async with self.engine.begin() as conn:
            return await conn.run_sync(fn, *args)

    async def _read(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        async with self.engine.connect() as conn:
            return await conn.run_sync(fn, *args)


def _lock_id(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
