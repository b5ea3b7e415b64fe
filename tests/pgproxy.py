"""A fault-injecting proxy in front of a real PostgreSQL server: a socket directory of its
own (`host` for a DATABASE_URL) whose connections are forwarded to the server's socket.

`lose_commit_answer(marker)`: on the next connection whose client sends `marker` (bytes
of a statement's parameters, e.g. a value only one INSERT carries), the transaction's
COMMIT is forwarded to the server and the server's answer is not: once the server has
answered it (CommandComplete `COMMIT`: committed, and flushed with the default
synchronous_commit), the connection is cut. The commit happened; the client cannot know
it, as when a server stops right after committing.

The proxy runs its own asyncio loop in a daemon thread; call its methods from the test."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import threading
from pathlib import Path

_CHUNK = 1 << 16
# The server's CommandComplete message (type C, length 11) for a COMMIT: sent once the
# transaction is committed (and, with synchronous_commit on, the default, flushed).
_COMMITTED = b"C\x00\x00\x00\x0bCOMMIT\x00"
_ANSWER_TIMEOUT_S = 30.0


class PgProxy:
    def __init__(self, upstream_dir: str | Path) -> None:
        self.upstream = str(Path(upstream_dir) / ".s.PGSQL.5432")
        self.dir = Path(tempfile.mkdtemp(prefix="oa-pgp-", dir="/tmp"))
        self._marker: bytes | None = None
        self.cut = threading.Event()  # set once a COMMIT's answer was lost
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> PgProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def lose_commit_answer(self, marker: bytes) -> None:
        self._loop.call_soon_threadsafe(setattr, self, "_marker", marker)

    def close(self) -> None:
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, str(self.dir / ".s.PGSQL.5432"))

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_unix_connection(self.upstream)
        cutting = asyncio.Event()
        committed = asyncio.Event()  # the server answered the COMMIT (not passed on)

        async def to_server() -> None:
            marked = False
            while chunk := await client_r.read(_CHUNK):
                marker = self._marker
                if marker is not None and marker in chunk:
                    marked = True
                if marked and b"COMMIT" in chunk:
                    self._marker = None
                    cutting.set()  # the answer to this is not passed on
                    server_w.write(chunk)
                    await server_w.drain()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(committed.wait(), _ANSWER_TIMEOUT_S)
                    self.cut.set()
                    return
                server_w.write(chunk)
                await server_w.drain()

        async def to_client() -> None:
            dropped = b""
            while chunk := await server_r.read(_CHUNK):
                if not cutting.is_set():
                    client_w.write(chunk)
                    await client_w.drain()
                    continue
                # Dropped: the cut comes from to_server, once the server has answered.
                dropped = dropped[-len(_COMMITTED) :] + chunk
                if _COMMITTED in dropped:
                    committed.set()

        tasks = [asyncio.ensure_future(to_server()), asyncio.ensure_future(to_client())]
        with contextlib.suppress(ConnectionError):
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for writer in (client_w, server_w):
            writer.close()
