"""How store transactions run: each is one plain function over a SQLAlchemy `Connection`,
executed whole.

- PostgreSQL: the async engine (asyncpg), `run_sync` inside one transaction.
- SQLite: a sync engine (the stdlib driver). Writes run on the event loop's thread in
  batches: the writes that arrive while one batch is being made durable run together
  next, in one transaction with one fsync (group commit), and one write's failure never
  touches another's (see _Sqlite._commit). The fsync is made by a helper process
  (_Syncer, store/syncer.py). Another process holding the file's write lock makes the
  batch wait without holding up the event loop (see _Sqlite._take_write_lock).
  Reads run on a small pool of threads, each with its own connection. Measured on the
  2-core test machine (static provider, in process): a lease round trip took ~51 ms
  through aiosqlite (every statement a thread round trip), ~10 ms with a writer thread,
  and ~2 ms this way with the lease path's statements prepared (store.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import sqlite3
import subprocess
import sys
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
# Key in the writer connection's `info`: how many of its transactions were rolled back
# (store._TakenCache relies on it).
ROLLBACKS = "openalice_rollbacks"
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
    while a batch is being made durable wait, then run together in one transaction
    (group commit).

    The writer commits with `synchronous=NORMAL`, which writes the WAL without an
    fsync, and with SQLITE_SYNCHRONOUS=full (the default) no job of the batch hears
    back before the helper process (_Syncer) has fsynced the WAL: what a caller was
    told is on disk, as with SQLite's FULL. Meanwhile the event loop serves other calls.
    Readers (other connections) may see a batch a fraction of a millisecond before it
    is durable; nobody is answered from it before.

    Not on a writer thread: SQLite releases the GIL for every statement step, so a
    thread that writes while the event loop runs Python waits for the GIL again at each
    step; measured at 32 concurrent clients, ~110 µs per statement spent waiting. For
    the same reason the fsync is not made on a thread either (see store/syncer.py)."""

    def __init__(self, url: URL, synchronous: str) -> None:
        url = url.set(drivername="sqlite+pysqlite")
        path = url.database
        self._syncer: _Syncer | None = None
        writer_pragmas = {"synchronous": "NORMAL"}
        if synchronous == "full" and path and path != ":memory:":
            self._syncer = _Syncer(str(Path(path).resolve()))
            # The helper checkpoints, off the event loop (with its fsyncs).
            writer_pragmas["wal_autocheckpoint"] = "0"
        # The writer's BEGIN IMMEDIATE is ours (_take_write_lock), its busy timeout 0: a
        # wait inside SQLite would stop the event loop, on whose thread writes run.
        self.writer_engine = _sqlite_engine(url, None, 1, writer_pragmas, busy_ms=0)
        self.reader_engine = _sqlite_engine(url, "BEGIN", _READERS,
                                            {"synchronous": synchronous.upper()})
        self._conn: Connection | None = None
        self._pending: list[_Job] = []
        self._flushing: asyncio.Task[None] | None = None
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
        self._readers.shutdown(wait=True)
        for conn in self._reader_conns:
            conn.close()
        if self._conn is not None:
            self._conn.close()
        self.writer_engine.dispose()
        self.reader_engine.dispose()
        if self._syncer is not None:
            self._syncer.close()

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
                # One turn of the loop before the next batch: the callers just settled
                # are answered, and the calls that came in meanwhile are read, so their
                # writes join that batch. At 32 clients batches grew from ~12 writes to
                # ~16 and the CPU per lease round trip fell by a tenth.
                await asyncio.sleep(0)
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
            try:
                for place, job in enumerate(batch):
                    before = raw.total_changes
                    try:
                        job.result = job.fn(conn, *job.args)
                    except Exception as exc:  # noqa: BLE001 - handed to the job's caller
                        job.error = exc
                        if raw.total_changes != before:
                            raise _Undo(place) from None
                transaction.commit()  # NORMAL: the WAL is written, not yet fsynced
            except BaseException:
                conn.info[ROLLBACKS] = conn.info.get(ROLLBACKS, 0) + 1
                if transaction.is_active:
                    transaction.rollback()
                raise
            if self._syncer is not None:
                await self._syncer.sync()
        except _Undo as undo:
            failed = batch.pop(undo.place)
            for job in batch:
                job.result = job.error = None
            self._pending[:0] = batch
            _settle(failed)
            return
        except Exception as exc:  # noqa: BLE001 - the commit itself failed: nobody's work stands
            # Also when the fsync failed: the batch is in the file but maybe not on disk,
            # and nobody is told it is.
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


class _Syncer:
    """The helper process that fsyncs the SQLite file for the writer (store/syncer.py:
    why, and its protocol). Started with the first write; a helper that died is started
    again and asked again, and since the batch is still in the page cache, that fsync
    covers it. Runs as long as this process: it ends when the pipe closes."""

    def __init__(self, db_path: str) -> None:
        self.db_path = db_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # where its answers are read
        # The callers of the requests sent and not yet answered, in order.
        self._waiting: collections.deque[asyncio.Future[bytes]] = collections.deque()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def sync(self) -> None:
        """Return once everything this process wrote to the file is on disk. Raises
        OSError when it cannot be made so."""
        for _attempt in range(2):
            try:
                answer = await self._ask()
            except OSError:  # the pipe is gone: the helper died
                answer = b""
            if answer == b"k":
                return
            if answer == b"e":
                raise OSError("fsync of the SQLite file failed (see the scheduler's log)")
            log.warning("state store: the SQLite sync helper exited; starting it again")
            self._stop()
        raise OSError("the SQLite sync helper does not answer")

    async def _ask(self) -> bytes:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # not started yet, or the store moved to another loop
            self._stop()
            self._start(loop)
        assert self._proc is not None and self._proc.stdin is not None
        os.write(self._proc.stdin.fileno(), b"s")
        answer = loop.create_future()  # after the write: one future per request sent
        self._waiting.append(answer)
        return await answer

    def command(self) -> list[str]:
        from openalice_scheduler.store import syncer

        return [sys.executable, "-I", "-S", syncer.__file__, self.db_path]

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
            env={},  # it needs none, and so holds none of the secrets
        )
        assert self._proc.stdout is not None
        out = self._proc.stdout.fileno()
        os.set_blocking(out, False)
        loop.add_reader(out, self._answered, loop, out)
        self._loop = loop

    def _answered(self, loop: asyncio.AbstractEventLoop, out: int) -> None:
        try:
            data = os.read(out, 4096)
        except BlockingIOError:
            return
        if not data:  # the helper is gone
            loop.remove_reader(out)
            self._give_up()
            return
        for byte in data:
            if self._waiting:
                self._resolve(self._waiting.popleft(), bytes((byte,)))

    @staticmethod
    def _resolve(answer: asyncio.Future[bytes], value: bytes) -> None:
        if not answer.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                answer.set_result(value)

    def _give_up(self) -> None:
        """Everyone still waiting for the helper hears that it will not answer."""
        while self._waiting:
            self._resolve(self._waiting.popleft(), b"")

    def _stop(self) -> None:
        proc = self._detach()
        self._give_up()
        if proc is None:
            return
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.stdout.close()
        proc.kill()
        proc.wait(5)

    def _detach(self) -> subprocess.Popen[bytes] | None:
        """Forget the helper (its answers are no longer read); returns it."""
        proc, loop, self._proc, self._loop = self._proc, self._loop, None, None
        if proc is not None and proc.stdout is not None and loop is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # a loop closed meanwhile
                loop.remove_reader(proc.stdout.fileno())
        return proc

    def close(self) -> None:
        """Close the pipe: the helper ends once it has answered what it was asked."""
        proc = self._detach()
        if proc is None:
            return
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()


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


def _sqlite_engine(url: URL, begin: str | None, pool_size: int, pragmas: dict[str, str], *,
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
        # synchronous: the writer's is NORMAL, see _Sqlite.
        for name, value in pragmas.items():
            cursor.execute(f"PRAGMA {name}={value}")
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.close()

    if begin is not None:
        @event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            conn.connection.driver_connection.execute(begin)  # type: ignore[union-attr]

    return engine


def ping(conn: Connection) -> None:
    conn.execute(text("SELECT 1"))
