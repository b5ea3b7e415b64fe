"""What the lease logic needs of a database, one implementation per dialect
(store/sqlite.py, store/postgres.py), chosen once by `store.open_store`.

A transaction is one plain function over a connection, run whole by `write` or `read`:
SQLAlchemy's `Connection` on SQLite; on PostgreSQL a `PgTx` (store/pg_tx.py), which
runs the same Core statements on asyncpg with the part of `Connection`'s API the store
uses (`execute`, `begin_nested`). The lease logic never asks which database it is on.
Schema work (Alembic) gets SQLAlchemy's own connection on both, from `schema`."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from openalice_scheduler.errors import StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


class Backend(Protocol):
    """A database the store runs its transactions on."""

    name: str
    # True when this process is the only one using the store (SQLite: one scheduler per
    # file): any other replica it finds recorded is gone, and so are its release claims.
    exclusive: bool
    # The database file, when there is one.
    path: Path | None

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(conn, *args)` in a write transaction, answered once it is durable.
        Its exceptions propagate and undo only its own work."""
        ...

    async def write_apart(self, fn: Callable[..., T], *args: Any) -> T:
        """`write`, on a connection kept apart from the traffic's, for the small writes
        that must not queue behind a burst of it: the replica's heartbeat. A replica whose
        every connection waits (on a lock, say) is alive all the same, and must not look
        dead to the others, who would then fail its provisions."""
        ...

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(conn, *args)` in a read-only transaction (one consistent snapshot)."""
        ...

    async def schema(self, fn: Callable[..., T], *args: Any) -> T:
        """`write`, with a SQLAlchemy `Connection` as `conn` (migrations, schema checks)."""
        ...

    def lock(self, conn: Connection, key: str) -> None:
        """Serialise the transactions of every replica that take `key`, until the end
        of this transaction."""
        ...

    def next_fence(self, conn: Connection) -> int:
        """The next fencing token of the store, in this transaction: larger than every
        one given before, by any replica, before or after a restart."""
        ...

    def announce_freed(self, conn: Connection) -> None:
        """Tell the other replicas, once this transaction commits, that capacity was
        freed (their waiting callers may try again)."""
        ...

    async def listen_freed(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever another replica freed capacity, until cancelled."""
        ...

    async def close(self) -> None: ...


async def guarded(work: Awaitable[T], also: tuple[type[BaseException], ...] = ()) -> T:
    """Database outages become StoreUnavailable (503), never a 500. So does a store too
    busy to lend a connection in time (the pool's timeout: under a burst bigger than the
    pool). A constraint that did its job (IntegrityError) is the caller's to interpret.
    `also`: a backend's own driver errors, for statements it runs on the driver."""
    unavailable: tuple[type[BaseException], ...] = (
        OperationalError,
        DBAPIError,
        PoolTimeout,
        OSError,
        sqlite3.DatabaseError,
        *also,
    )
    try:
        return await work
    except (IntegrityError, sqlite3.IntegrityError):
        raise
    except unavailable as exc:
        log.warning("state store unavailable: %s", type(exc).__name__)
        raise StoreUnavailable(
            "the state store is unavailable; try again shortly",
            cause=type(exc).__name__,
        ) from exc
