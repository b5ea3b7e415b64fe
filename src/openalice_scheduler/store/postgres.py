"""PostgreSQL: several replicas on one database, through SQLAlchemy's async engine on
asyncpg. Transactions that must not interleave across replicas take advisory locks;
freed capacity is announced with NOTIFY and heard with LISTEN. At start-up,
`wait_until_reachable` waits for a server that is not up yet."""

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

from sqlalchemy import event, text
from sqlalchemy.engine import URL, Connection
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from openalice_scheduler.errors import StartupError
from openalice_scheduler.store.backend import guarded

log = logging.getLogger(__name__)
T = TypeVar("T")

# The channel on which replicas announce freed capacity to each other's waiters.
CAPACITY_CHANNEL = "openalice_capacity"
# One start-up connection attempt waits at most this long (a host that drops packets).
CONNECT_TIMEOUT_S = 10.0


class PostgresBackend:
    name = "postgresql"
    exclusive = False
    path: Path | None = None

    def __init__(self, url: URL) -> None:
        self.url = url
        self.engine: AsyncEngine = create_async_engine(
            url.set(drivername="postgresql+asyncpg"), pool_size=10, max_overflow=20,
        )
        # A pooled connection the server closed (a restart) is replaced at checkout, as
        # `pool_pre_ping` would, but from what asyncpg already knows: its socket was
        # closed. pre_ping asked the server each time (BEGIN, `;`, ROLLBACK: three round
        # trips per transaction, a third of the lease path's). A connection that died
        # unseen fails its transaction (503) and SQLAlchemy then discards the whole pool.
        event.listen(self.engine.sync_engine, "checkout", _closed_by_server)

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
        url.set(drivername="postgresql+asyncpg"), poolclass=NullPool,
        connect_args={"timeout": min(CONNECT_TIMEOUT_S, max(1.0, timeout))},
    )

    def retrying(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("state store: PostgreSQL at %s unreachable (%s); retrying in %.1f s "
                    "(attempt %d, STARTUP_TIMEOUT_SECONDS=%g)", where, _reason(exc),
                    state.upcoming_sleep, state.attempt_number, timeout)

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
    import asyncpg

    exc = _driver_error(exc)
    if isinstance(exc, ssl.SSLError):  # an OSError too, but a definite answer
        return False
    return isinstance(exc, (OSError, TimeoutError, asyncpg.CannotConnectNowError,
                            asyncpg.TooManyConnectionsError,
                            asyncpg.ConnectionDoesNotExistError))


def _reason(exc: BaseException | None) -> str:
    """Why a connection failed, in words; the server's own message when it answered
    (it names the user or the database, never the password)."""
    exc = _driver_error(exc) if exc is not None else None
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, OSError) and exc.strerror:
        # asyncio words a refusal "Connect call failed (address)": errno says it plainly.
        text = (os.strerror(exc.errno) if exc.errno and not isinstance(exc, socket.gaierror)
                else exc.strerror)
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


def _closed_by_server(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    if dbapi_connection.driver_connection.is_closed():
        raise DisconnectionError("the server closed this connection")


def _lock_id(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
