"""What the lease logic needs of a database, one implementation per dialect
(store/sqlite.py, store/postgres.py), chosen once by `store.open_store`.

A transaction is one plain function over a SQLAlchemy `Connection`, run whole by
`write` or `read`; the lease logic never asks which database it is on."""

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

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(conn, *args)` in a read-only transaction (one consistent snapshot)."""
        ...

    def lock(self, conn: Connection, key: str) -> None:
        """Serialise the transactions of every replica that take `key`, until the end
        of this transaction."""
        ...

    def announce_freed(self, conn: Connection) -> None:
        """Tell the other replicas, once this transaction commits, that capacity was
        freed (their waiting callers may try again)."""
        ...

    async def listen_freed(self, callback: Callable[[], None]) -> None:
        """Call `callback` whenever another replica freed capacity, until cancelled."""
        ...

    async def close(self) -> None: ...


async def guarded(work: Awaitable[T]) -> T:
    """Database outages become StoreUnavailable (503), never a 500: so does a pool with
    no connection free in time (a server too slow for the load). A constraint that did
    its job (IntegrityError) is the caller's to interpret."""
    try:
        return await work
    except (IntegrityError, sqlite3.IntegrityError):
        raise
    except (OperationalError, DBAPIError, PoolTimeout, OSError, sqlite3.DatabaseError) as exc:
        log.warning("state store unavailable: %s", type(exc).__name__)
        raise StoreUnavailable(
            "the state store is unavailable; try again shortly", cause=type(exc).__name__,
        ) from exc
