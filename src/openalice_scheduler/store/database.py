"""How store transactions run: each is one plain function over a SQLAlchemy `Connection`,
executed whole.

- PostgreSQL: the async engine (asyncpg), `run_sync` inside one transaction.
- SQLite: a sync engine (the stdlib driver). Writes run on the event loop's thread in
  batches: the writes that arrive while one batch is being committed run together next,
  in one transaction with one fsync (group commit), and one write's failure never
  touches another's (see _Sqlite._commit); the COMMIT runs on a thread of its own.
  Another process holding the file's write lock makes the batch wait without holding
  up the event loop (see _Sqlite._take_write_lock).
  Reads run on a small pool of threads, each with its own connection. Measured on the
  2-core test machine (static provider, in process): a lease round trip took ~51 ms
  through aiosqlite (every statement a thread round trip), ~10 ms with a writer thread,
  and ~2 ms this way with the lease path's statements prepared (store.py).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from openalice_scheduler.errors import StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

_MAX_BATCH = 128
_READERS = 3
# Waiting for another process's write lock on the SQLite file: the first retry, the
# longest pause between two, and when to give up (503), as SQLite's own busy_timeout did.
_LOCKED_FIRST_S = 0.001
_LOCKED_MAX_PAUSE_S = 0.05
_LOCKED_TIMEOUT_S = 30.0


class Database:
    def __init__(self, database_url: str, *, sqlite_synchronous: str = "full") -> None:
        url = make_url(database_url)
        self.dialect = url.get_backend_name()
        if self.dialect in ("postgresql", "postgres"):
            self.dialect = "postgresql"
            self._impl: _Postgres | _Sqlite = _Postgres(url)
        elif self.dialect == "sqlite":
            self._impl = _Sqlite(url, sqlite_synchronous)
        else:
            raise ValueError(f"unsupported DATABASE_URL scheme {self.dialect!r}")
        self.url = url

    @property
    def sqlite_path(self) -> Path | None:
        if self.dialect != "sqlite" or not self.url.database or self.url.database == ":memory:":
            return None
        return Path(self.url.database).resolve()

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(conn, *args)` in a write transaction; its exceptions propagate and
        roll back only its own work."""
        return await self._guard(self._impl.write(fn, *args))

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(conn, *args)` in a read-only transaction (one consistent snapshot)."""
        return await self._guard(self._impl.read(fn, *args))

    async def close(self) -> None:
        await self._impl.close()

    async def listen(self, channel: str, callback: Callable[[], None]) -> None:
        """PostgreSQL LISTEN on `channel` until cancelled, reconnecting after outages;
        returns at once on SQLite."""
        if isinstance(self._impl, _Postgres):
            await self._impl.listen(channel, callback)

    async def _guard(self, work: Any) -> Any:
        """Database outages become StoreUnavailable (503), never a 500."""
        try:
            return await work
        except (IntegrityError, sqlite3.IntegrityError):
            raise  # a constraint did its job: the caller decides what it means
        # sqlite3's own errors too: the lease path runs its statements on the driver.
        except (OperationalError, DBAPIError, OSError, sqlite3.DatabaseError) as exc:
            log.warning("state store unavailable: %s", type(exc).__name__)
            raise StoreUnavailable(
                "the state store is unavailable; try again shortly",
                cause=type(exc).__name__,
            ) from exc


class _Postgres:
    def __init__(self, url: URL) -> None:
        self.url = url
        self.engine: AsyncEngine = create_async_engine(
            url.set(drivername="postgresql+asyncpg"), pool_pre_ping=True, pool_size=10,
            max_overflow=20,
        )

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        async with self.engine.begin() as conn:
            return await conn.run_sync(fn, *args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        async with self.engine.connect() as conn:
            return await conn.run_sync(fn, *args)

    async def close(self) -> None:
        await self.engine.dispose()

    async def listen(self, channel: str, callback: Callable[[], None]) -> None:
        import asyncpg

        dsn = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        while True:
            try:
                conn = await asyncpg.connect(dsn)
            except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
                log.debug("LISTEN %s: cannot connect (%s); retrying", channel, type(exc).__name__)
                await asyncio.sleep(1.0)
                continue
            lost = asyncio.Event()
            conn.add_termination_listener(lambda _c, done=lost: done.set())
            try:
                await conn.add_listener(channel, lambda *_args: callback())
                callback()  # capacity may have been freed while we were not listening
                await lost.wait()
            except (OSError, asyncpg.PostgresError):
                pass
            finally:
                if not conn.is_closed():
                    await conn.close(timeout=2)
            await asyncio.sleep(0.5)


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    # Loop time after which the job stops waiting for another process's write lock.
    deadline: float
    result: Any = None
    error: BaseException | None = field(default=None)


class _Sqlite:
    """Writes run on the event loop's thread, one batch at a time: the jobs that arrive
    while a commit is being made to disk wait, then run together in one transaction,
    whose COMMIT (the fsync) runs on a thread of its own (group commit).

    Not on a writer thread: SQLite releases the GIL for every statement step, so a
    thread that writes while the event loop runs Python waits for the GIL again at each
    step; measured at 32 concurrent clients, ~110 µs per statement spent waiting."""

    def __init__(self, url: URL, synchronous: str) -> None:
        url = url.set(drivername="sqlite+pysqlite")
        # The writer's BEGIN IMMEDIATE is ours (_take_write_lock), its busy timeout 0: a
        # wait inside SQLite would stop the event loop, on whose thread writes run.
        self.writer_engine = _sqlite_engine(url, None, 1, synchronous, busy_ms=0)
        self.reader_engine = _sqlite_engine(url, "BEGIN", _READERS, synchronous)
        self._conn: Connection | None = None
        self._pending: list[_Job] = []
        self._flushing: asyncio.Task[None] | None = None
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="sqlite-commit")
        self._readers = ThreadPoolExecutor(_READERS, thread_name_prefix="sqlite-read")
        # Each reader thread keeps its connection: a pool checkout per read costs more
        # than most reads.
        self._local = threading.local()
        self._reader_conns: list[Connection] = []

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, loop.create_future(), loop.time() + _LOCKED_TIMEOUT_S)
        self._pending.append(job)
        if self._flushing is None:
            # Started on the next turn of the loop: writes issued meanwhile join in.
            self._flushing = loop.create_task(self._flush())
        return await job.future

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._readers, self._read_sync, fn, args)

    async def close(self) -> None:
        if self._flushing is not None:
            await asyncio.shield(self._flushing)
        self._committer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        for conn in self._reader_conns:
            conn.close()
        if self._conn is not None:
            self._conn.close()
        self.writer_engine.dispose()
        self.reader_engine.dispose()

    def _read_sync(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        conn: Connection | None = getattr(self._local, "conn", None)
        if conn is None or conn.invalidated or conn.closed:
            conn = self._local.conn = self.reader_engine.connect()
            self._reader_conns.append(conn)
        with conn.begin():
            return fn(conn, *args)

    async def _flush(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:_MAX_BATCH], self._pending[_MAX_BATCH:]
                await self._commit(batch)
        finally:
            self._flushing = None

    async def _commit(self, batch: list[_Job]) -> None:
        # A job that fails without having written anything (a check: at capacity, not
        # found...) leaves the others' work untouched, so jobs need no savepoints, which
        # would double the statements. One that fails after writing takes the whole
        # transaction back; the other jobs of the batch then run again in the next one.
        try:
            if self._conn is None or self._conn.invalidated or self._conn.closed:
                self._conn = self.writer_engine.connect()
            conn = self._conn
            raw = conn.connection.driver_connection
            assert raw is not None
            if not await self._take_write_lock(raw, batch):
                return  # every job of the batch gave up waiting for the lock
            transaction = conn.begin()  # in the transaction just begun
            commit: asyncio.Future[None] | None = None
            try:
                for place, job in enumerate(batch):
                    before = raw.total_changes
                    try:
                        job.result = job.fn(conn, *job.args)
                    except Exception as exc:  # noqa: BLE001 - handed to the job's caller
                        job.error = exc
                        if raw.total_changes != before:
                            raise _Undo(place) from None
                commit = asyncio.get_running_loop().run_in_executor(
                    self._committer, transaction.commit
                )
                await commit
            except BaseException:
                # Never while the COMMIT still runs on its thread (this task cancelled).
                if transaction.is_active and (commit is None or commit.done()):
                    transaction.rollback()
                raise
        except _Undo as undo:
            failed = batch.pop(undo.place)
            for job in batch:
                job.result = job.error = None
            self._pending[:0] = batch
            _settle(failed)
            return
        except Exception as exc:  # noqa: BLE001 - the commit itself failed: nobody's work stands
            for job in batch:
                if job.error is None:
                    job.error = exc
        for job in batch:
            _settle(job)

    @staticmethod
    async def _take_write_lock(raw: sqlite3.Connection, batch: list[_Job]) -> bool:
        """BEGIN IMMEDIATE, waiting on the event loop (not in SQLite's busy handler) while
        another process holds the file's write lock: a scheduler never does (one process
        per file), a tool writing to it may. Meanwhile reads, health and metrics answer.

        Each job waits at most _LOCKED_TIMEOUT_S from its own arrival, also when it
        arrived behind a batch that was already waiting: past that it leaves the batch
        with StoreUnavailable (503). False when no job is left."""
        loop = asyncio.get_running_loop()
        pause = 0.0
        while True:
            try:
                raw.execute("BEGIN IMMEDIATE")
                return True
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY:
                    raise
            if not pause:
                pause = _LOCKED_FIRST_S
                log.info("state store: another process holds the SQLite write lock; waiting")
            now = loop.time()
            expired = [job for job in batch if job.deadline <= now]
            if expired:
                log.warning("state store: SQLite write lock still held by another process; "
                            "%d write(s) gave up after %.0f s", len(expired), _LOCKED_TIMEOUT_S)
                for job in expired:
                    batch.remove(job)
                    job.error = StoreUnavailable(
                        "the state store is unavailable: another process holds the SQLite "
                        "file's write lock; try again shortly", cause="locked",
                    )
                    _settle(job)
                if not batch:
                    return False
            await asyncio.sleep(pause)
            pause = min(pause * 2, _LOCKED_MAX_PAUSE_S)


class _Undo(Exception):
    """A job failed after writing: its transaction must go."""

    def __init__(self, place: int) -> None:
        super().__init__(place)
        self.place = place


def _settle(job: _Job) -> None:
    if job.future.cancelled():
        return
    if job.error is not None:
        job.future.set_exception(job.error)
    else:
        job.future.set_result(job.result)


def _sqlite_engine(url: URL, begin: str | None, pool_size: int, synchronous: str, *,
                   busy_ms: int = 30000) -> Engine:
    """`begin`: the statement that opens each transaction; None when the caller has
    already opened it on the driver's connection."""
    engine = create_engine(
        url, pool_size=pool_size, max_overflow=0,
        connect_args={"timeout": busy_ms / 1000, "check_same_thread": False},
    )

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        # Transactions are ours, not the driver's: savepoints need that.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # FULL (default): a committed lease survives power loss too. NORMAL: it survives
        # a killed process, and the last commits may be lost if the machine loses power.
        cursor.execute(f"PRAGMA synchronous={synchronous.upper()}")
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.close()

    if begin is not None:
        @event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            conn.connection.driver_connection.execute(begin)  # type: ignore[union-attr]

    return engine


def ping(conn: Connection) -> None:
    conn.execute(text("SELECT 1"))
