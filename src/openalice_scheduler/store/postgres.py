"""PostgreSQL: several replicas on one database. The store's transactions run on an
asyncpg pool of connections (store/pg_tx.py); schema work (Alembic) runs through
SQLAlchemy's async engine. Transactions that must not interleave across replicas take
advisory locks; freed capacity is announced with NOTIFY and heard with LISTEN. At
start-up, `wait_until_reachable` waits for a server that is not up yet."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
from sqlalchemy import text
from sqlalchemy.engine import URL, Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

from openalice_scheduler.errors import StartupError
from openalice_scheduler.store.backend import guarded
from openalice_scheduler.store.pg_tx import PgTx, run_in_greenlet

log = logging.getLogger(__name__)
T = TypeVar("T")

# The channel on which replicas announce freed capacity to each other's waiters.
CAPACITY_CHANNEL = "openalice_capacity"
# Built once, like the lease path's statements: compiled and prepared once (pg_tx.py).
_LOCK = text("SELECT pg_advisory_xact_lock(:key)")
_NOTIFY = text(f"NOTIFY {CAPACITY_CHANNEL}")
_NEXT_FENCE = text("SELECT nextval('lease_fence')")
# One start-up connection attempt waits at most this long (a host that drops packets).
CONNECT_TIMEOUT_S = 10.0
# Connections kept open for transactions, and how long a transaction waits for one
# before it fails (503): a burst larger than the pool queues, a stuck server does not
# hold callers forever.
POOL_MIN, POOL_MAX = 2, 30
POOL_WAIT_S = 30.0
# What asyncpg raises when the server is gone or refuses: the store is unavailable (503),
# as SQLAlchemy's engine reported every asyncpg error (DBAPIError). InternalClientError
# comes when the server ended the connection after the transaction's last statement:
# its COMMIT was never sent (asyncpg refuses to start it), so nothing was committed.
DRIVER_ERRORS = (
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    TimeoutError,
)


class PostgresBackend:
    name = "postgresql"
    exclusive = False
    path: Path | None = None

    def __init__(
        self, url: URL, *, pool_max: int = POOL_MAX, pool_wait_s: float = POOL_WAIT_S
    ) -> None:
        self.url = url
        self.pool_max, self.pool_wait_s = pool_max, pool_wait_s
        self._dsn = url.set(drivername="postgresql").render_as_string(hide_password=False)
        # Made by the first transaction (it needs the event loop). asyncpg replaces a
        # pooled connection the server closed (a restart) when it is next acquired; one
        # that died unseen fails its transaction (503) and is replaced then.
        self._pool: asyncpg.Pool | None = None
        self._pool_made = asyncio.Lock()
        # `write_apart`'s own connection, made when first needed and again after it broke.
        self._apart: asyncpg.Connection | None = None
        self._apart_lock = asyncio.Lock()

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        return await guarded(self._run(fn, args, readonly=False), also=DRIVER_ERRORS)

    async def write_apart(self, fn: Callable[..., T], *args: Any) -> T:
        return await guarded(self._run_apart(fn, args), also=DRIVER_ERRORS)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        return await guarded(self._run(fn, args, readonly=True), also=DRIVER_ERRORS)

    async def schema(self, fn: Callable[..., T], *args: Any) -> T:
        # Alembic needs SQLAlchemy's own connection; rare, so no pool is kept for it.
        engine = create_async_engine(url_for_sqlalchemy(self.url), poolclass=NullPool)
        try:
            async with engine.begin() as conn:
                return await guarded(conn.run_sync(fn, *args))
        finally:
            await engine.dispose()

    def lock(self, conn: Connection, key: str) -> None:
        conn.execute(_LOCK, {"key": advisory_key(key)})

    def next_fence(self, conn: Connection) -> int:
        """From the SEQUENCE `lease_fence` (migration 0008): no row lock held until
        COMMIT, so acquires on every replica never queue for it. A lease reserved after
        another one's release (the same endpoint, GPU or warm worker) gets a larger value;
        a value whose transaction rolls back is skipped, never given again."""
        return int(conn.execute(_NEXT_FENCE).scalar_one())

    def announce_freed(self, conn: Connection) -> None:
        conn.execute(_NOTIFY)  # delivered on commit

    async def listen_freed(self, callback: Callable[[], None]) -> None:
        """LISTEN until cancelled, connecting again after an outage."""
        while True:
            try:
                conn = await asyncpg.connect(self._dsn)
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
        if self._apart is not None and not self._apart.is_closed():
            await self._apart.close(timeout=2)
        if self._pool is not None:
            await self._pool.close()

    async def _run(self, fn: Callable[..., T], args: tuple[Any, ...], readonly: bool) -> T:
        pool = self._pool or await self._make_pool()
        async with pool.acquire(timeout=self.pool_wait_s) as conn:
            # A read sees one snapshot; a write sees what committed before each statement
            # (READ COMMITTED, as SQLAlchemy's engine ran them), its guarded updates and
            # advisory locks doing the serialising.
            isolation = "repeatable_read" if readonly else None
            async with conn.transaction(isolation=isolation, readonly=readonly):
                return await run_in_greenlet(fn, PgTx(conn), *args)

    async def _run_apart(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        async with self._apart_lock:
            if self._apart is None or self._apart.is_closed():
                self._apart = await asyncpg.connect(self._dsn, timeout=CONNECT_TIMEOUT_S)
            async with self._apart.transaction():
                return await run_in_greenlet(fn, PgTx(self._apart), *args)

    async def _make_pool(self) -> asyncpg.Pool:
        async with self._pool_made:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(
                    self._dsn,
                    min_size=min(POOL_MIN, self.pool_max),
                    max_size=self.pool_max,
                    # Statements are prepared once per connection and kept (asyncpg's
                    # cache), so each transaction only binds and executes.
                    statement_cache_size=256,
                )
            return self._pool


async def wait_until_reachable(url: URL, timeout: float) -> None:
    """Connect once, the way the store will, retrying with exponential backoff for up to
    `timeout` seconds while the server cannot be reached: refused, name not resolvable
    yet, no answer, or still starting up. A definite answer (wrong password, no such
    role or database) is not retried: waiting would not change it. Raises StartupError,
    one line naming the host and port (never the password) and why."""
    import tenacity

    where = _where(url)
    # The store's own driver and URL handling, without a pool: nothing is kept open.
    engine = create_async_engine(
        url_for_sqlalchemy(url),
        poolclass=NullPool,
        connect_args={"timeout": min(CONNECT_TIMEOUT_S, max(1.0, timeout))},
    )

    def retrying(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning(
            "state store: PostgreSQL at %s unreachable (%s); retrying in %.1f s "
            "(attempt %d, STARTUP_TIMEOUT_SECONDS=%g)",
            where,
            _reason(exc),
            state.upcoming_sleep,
            state.attempt_number,
            timeout,
        )

    try:
        async for attempt in tenacity.AsyncRetrying(
            stop=tenacity.stop_before_delay(timeout),
            wait=tenacity.wait_exponential_jitter(initial=0.5, max=5.0, jitter=0.5),
            retry=tenacity.retry_if_exception(_unreachable),
            before_sleep=retrying,
            reraise=True,
        ):
            with attempt:
                async with engine.connect():
                    pass
    except Exception as exc:  # noqa: BLE001 - every failure becomes the one line
        if _unreachable(exc):
            raise StartupError(
                f"DATABASE_URL: PostgreSQL at {where} still unreachable after "
                f"{timeout:g} s ({_reason(exc)}); STARTUP_TIMEOUT_SECONDS sets how long "
                "start-up waits"
            ) from None
        raise StartupError(
            f"DATABASE_URL: cannot connect to PostgreSQL at {where}: {_reason(exc)}"
        ) from None
    finally:
        await engine.dispose()


def _unreachable(exc: BaseException) -> bool:
    """Whether waiting may help: no server answered, or it said it is starting up."""
    exc = _driver_error(exc)
    if isinstance(exc, ssl.SSLError):  # an OSError too, but a definite answer
        return False
    return isinstance(
        exc,
        (
            OSError,
            TimeoutError,
            asyncpg.CannotConnectNowError,
            asyncpg.TooManyConnectionsError,
            asyncpg.ConnectionDoesNotExistError,
        ),
    )


def _reason(exc: BaseException | None) -> str:
    """Why a connection failed, in words; the server's own message when it answered
    (it names the user or the database, never the password)."""
    exc = _driver_error(exc) if exc is not None else None
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, OSError) and exc.strerror:
        # asyncio words a refusal "Connect call failed (address)": errno says it plainly.
        text = (
            os.strerror(exc.errno)
            if exc.errno and not isinstance(exc, socket.gaierror)
            else exc.strerror
        )
        return text[:1].lower() + text[1:]
    return str(exc) or type(exc).__name__


def _driver_error(exc: BaseException) -> BaseException:
    """asyncpg's own exception under SQLAlchemy's DBAPIError and its adapter class
    (`orig`, then the cause); OS errors come through unwrapped."""
    if isinstance(exc, DBAPIError) and exc.orig is not None:
        return exc.orig.__cause__ or exc.orig
    return exc


def _where(url: URL) -> str:
    """`host:port` the URL points at (a socket directory for `?host=/path`), as
    PostgreSQL's own tools print it."""
    host = url.host or url.query.get("host") or "localhost"
    port = url.port or url.query.get("port") or 5432
    if isinstance(host, tuple):  # several hosts, tried in turn
        host = ",".join(host)
    if isinstance(port, tuple):
        port = ",".join(port)
    return f"{host}:{port}"


def url_for_sqlalchemy(url: URL) -> URL:
    return url.set(drivername="postgresql+asyncpg")


def advisory_key(key: str) -> int:
    """The number of the advisory lock `lock(conn, key)` takes (another session may take
    it too: a test holding it from outside)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
