"""SQLite: one scheduler process per file, durability SQLite's own.

- Writes run on one writer thread, in batches: the writes that arrive while a batch is
  being committed run together next, in one transaction (group commit), each inside a
  savepoint of its own, so one write's failure undoes only its own work. The batch is
  committed with `synchronous=FULL` (SQLITE_SYNCHRONOUS), and nobody hears back before
  that COMMIT returned.
  Should the COMMIT fail, the transaction is rolled back and every write of the batch
  fails: nothing of it stays, nobody is told it succeeded.
- Another process holding the file's write lock (an operator's `sqlite3` shell) makes
  the writer thread wait in SQLite's own busy handler, off the event loop; each write
  waits at most WRITE_LOCK_TIMEOUT_S from its own arrival, then fails (503).
- Reads run on a small pool of threads, each with its own connection (WAL mode lets
  them read while a batch is written).
- The file is locked (flock on `<file>.lock`) for the process's life: a second
  scheduler on the same file refuses to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

from sqlalchemy import Engine, create_engine, event, update
from sqlalchemy.engine import URL, Connection

from openalice_scheduler.errors import StartupError, StoreUnavailable
from openalice_scheduler.store.backend import guarded
from openalice_scheduler.store.schema import fence_counter

log = logging.getLogger(__name__)
T = TypeVar("T")

WRITE_LOCK_TIMEOUT_S = 30.0
_NEXT_FENCE = (
    update(fence_counter)
    .where(fence_counter.c.id == 1)
    .values(last=fence_counter.c.last + 1)
    .returning(fence_counter.c.last)
)
_MAX_BATCH = 256
_READERS = 3


@dataclass(slots=True)
class _Write:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    # Loop time past which this write stops waiting for another process's write lock.
    deadline: float
    result: Any = None
    error: BaseException | None = None


class SqliteBackend:
    name = "sqlite"
    exclusive = True

    def __init__(self, url: URL, *, synchronous: str = "full") -> None:
        url = url.set(drivername="sqlite+pysqlite")
        database = url.database
        self.path = Path(database).resolve() if database and database != ":memory:" else None
        self._file_lock = _lock_file(self.path)
        _check_opens(self.path)
        self._writer_engine = _engine(url, "BEGIN IMMEDIATE", 1, synchronous)
        self._reader_engine = _engine(url, "BEGIN", _READERS, synchronous)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sqlite-write")
        self._readers = ThreadPoolExecutor(_READERS, thread_name_prefix="sqlite-read")
        self._writer_conn: Connection | None = None  # used on the writer thread only
        self._local = threading.local()  # each reader thread keeps its connection
        self._connections: list[Connection] = []
        self._pending: list[_Write] = []
        self._flushing: asyncio.Task[None] | None = None

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        write = _Write(fn, args, loop.create_future(), loop.time() + WRITE_LOCK_TIMEOUT_S)
        self._pending.append(write)
        if self._flushing is None:
            self._flushing = loop.create_task(self._flush())
        return await guarded(write.future)

    async def write_apart(self, fn: Callable[..., T], *args: Any) -> T:
        # One process, one writer: there is no traffic of other replicas to stay apart from.
        return await self.write(fn, *args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await guarded(loop.run_in_executor(self._readers, self._read, fn, args))

    async def schema(self, fn: Callable[..., T], *args: Any) -> T:
        return await self.write(fn, *args)  # its transactions have SQLAlchemy's Connection

    def lock(self, conn: Connection, key: str) -> None:
        """Nothing to do: one writer runs every transaction, one at a time."""

    def next_fence(self, conn: Connection) -> int:
        """The counter's one row, moved in this transaction: one writer, so strictly
        increasing; undone with the transaction (a fence is never given twice)."""
        return int(conn.execute(_NEXT_FENCE).scalar_one())

    def announce_freed(self, conn: Connection) -> None:
        """Nothing to do: no other process uses the file."""

    async def listen_freed(self, callback: Callable[[], None]) -> None:
        """No other replica can free capacity: nothing to hear."""

    async def close(self) -> None:
        if self._flushing is not None:
            await asyncio.shield(self._flushing)
        for pool in (self._writer, self._readers):
            pool.shutdown(wait=True)
        for conn in self._connections:
            conn.close()
        self._writer_engine.dispose()
        self._reader_engine.dispose()
        if self._file_lock is not None:
            self._file_lock.close()

    # --- writes ----------------------------------------------------------------------

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending[:_MAX_BATCH], self._pending[_MAX_BATCH:]
                wait_s = max(0.0, min(w.deadline for w in batch) - loop.time())
                locked = await loop.run_in_executor(self._writer, self._commit, batch, wait_s)
                if locked:
                    self._give_up_waiting(batch, loop.time())
                else:
                    for write in batch:
                        _settle(write)
        finally:
            self._flushing = None

    def _give_up_waiting(self, batch: list[_Write], now: float) -> None:
        """Another process held the write lock all along: the writes past their own
        deadline fail, the others are tried again first."""
        late = [w for w in batch if w.deadline <= now]
        if late:
            log.warning(
                "state store: another process holds the SQLite write lock; %d "
                "write(s) gave up after %.0f s",
                len(late),
                WRITE_LOCK_TIMEOUT_S,
            )
        for write in late:
            write.error = StoreUnavailable(
                "the state store is unavailable: another process holds the SQLite file's "
                "write lock; try again shortly",
                cause="locked",
            )
            _settle(write)
        self._pending[:0] = [w for w in batch if w.deadline > now]

    def _commit(self, batch: list[_Write], wait_s: float) -> bool:
        """Run `batch` in one transaction on the writer thread. True when the write lock
        could not be had within `wait_s` (nothing ran)."""
        if self._writer_conn is None or self._writer_conn.invalidated:
            try:
                self._writer_conn = self._connect(self._writer_engine)
            except Exception as exc:  # noqa: BLE001 - the batch's callers hear of it
                for write in batch:  # raised here, it would leave them waiting forever
                    write.error = exc
                return False
        conn = self._writer_conn
        raw = conn.connection.driver_connection
        assert raw is not None
        raw.execute(f"PRAGMA busy_timeout = {max(1, int(wait_s * 1000))}")
        try:
            transaction = conn.begin()
        except Exception as exc:  # noqa: BLE001 - decided below
            if _busy(exc):
                return True
            for write in batch:
                write.error = exc
            return False
        try:
            for write in batch:
                write.result, write.error = None, None
                try:
                    with conn.begin_nested():
                        write.result = write.fn(conn, *write.args)
                except Exception as exc:  # noqa: BLE001 - handed to the write's caller
                    write.error = exc
            transaction.commit()
        except Exception as exc:  # noqa: BLE001 - the commit failed: nobody's work stands
            log.error(
                "state store: SQLite commit failed (%s); the batch is undone", type(exc).__name__
            )
            with contextlib.suppress(Exception):
                transaction.rollback()
            if raw.in_transaction:  # could not even roll back: drop the connection
                conn.invalidate()
            for write in batch:
                write.result, write.error = None, write.error or exc
        return False

    # --- reads -----------------------------------------------------------------------

    def _read(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is None or conn.invalidated:
            conn = self._local.conn = self._connect(self._reader_engine)
        with conn.begin():
            return fn(conn, *args)

    def _connect(self, engine: Engine) -> Connection:
        conn = engine.connect()
        self._connections.append(conn)  # closed by close()
        return conn


def _settle(write: _Write) -> None:
    if write.future.cancelled():
        return
    if write.error is not None:
        write.future.set_exception(write.error)
    else:
        write.future.set_result(write.result)


def _busy(exc: BaseException) -> bool:
    cause = getattr(exc, "orig", exc)
    return (
        isinstance(cause, sqlite3.OperationalError)
        and getattr(cause, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY
    )


def _engine(url: URL, begin: str, pool_size: int, synchronous: str) -> Engine:
    """An engine whose transactions open with `begin`, in WAL mode. With synchronous
    FULL (the default), a COMMIT returns once the transaction is on disk; with NORMAL
    the last transactions may be lost on power loss (not on a killed process)."""
    engine = create_engine(
        url, pool_size=pool_size, max_overflow=0, connect_args={"check_same_thread": False}
    )

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        # Transactions are ours (the `begin` event), not the driver's: savepoints and
        # BEGIN IMMEDIATE need that.
        dbapi_connection.isolation_level = None
        for pragma in ("journal_mode=WAL", f"synchronous={synchronous.upper()}"):
            dbapi_connection.execute(f"PRAGMA {pragma}")

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.connection.driver_connection.execute(begin)  # type: ignore[union-attr]

    return engine


def _check_opens(path: Path | None) -> None:
    """Open the database once, now: a path that is a directory or not a database fails
    start-up with one line here, where in the lifespan it would be a traceback."""
    if path is None:
        return
    try:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            conn.execute("PRAGMA schema_version")  # reads the file's header
    except sqlite3.Error as exc:
        raise StartupError(f"DATABASE_URL: cannot open the SQLite database {path}: {exc}") from None


def _lock_file(path: Path | None) -> IO[str] | None:
    """Hold an exclusive lock on a file beside the database for the process's life:
    only one scheduler process may serve a SQLite file."""
    if path is None:
        return None
    try:
        if not path.parent.exists():  # a file in the way is then "Not a directory"
            path.parent.mkdir(parents=True)
        handle = open(f"{path}.lock", "a+")  # noqa: SIM115 - held open for the store's life
    except OSError as exc:
        raise StartupError(
            f"DATABASE_URL: cannot open the SQLite database {path}: {exc.strerror}"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise StartupError(
            f"DATABASE_URL: {path} is already served by another scheduler process "
            "(SQLite allows one; use PostgreSQL for several replicas)"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
