"""A small fault-injecting proxy in front of a real Docker engine, for fault tests.

It listens on a unix socket and forwards every connection to the engine's socket
(`/var/run/docker.sock` by default). Point a scheduler at it with
`DOCKER_HOST=unix://<path>`. It understands just enough HTTP/1.1 to find request
boundaries on a kept-alive connection (the docker SDK reuses connections): it reads
each request head, then the body (Content-Length or chunked), and forwards them;
responses are piped back raw. Faults:

- `delay(pattern, seconds)`: a request whose `"<METHOD> <path>"` matches the regex is
  read whole, then held for `seconds` before it is forwarded (`held` counts the ones
  waiting now; `wait_held(n)` waits until that is n). A held request whose client went
  away meanwhile is dropped at once, never forwarded; `drop_held()` drops all held
  requests now (their connections are closed unanswered).
- `stop()`: the listener and every open connection are closed, so the engine is
  unreachable (connections are refused); `start()` serves again on the same path.

The proxy runs its own asyncio loop in a daemon thread; every method here is called
from the test's thread."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HEAD_LIMIT = 1 << 20
_CHUNK = 1 << 16


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    seconds: float


class DockerProxy:
    def __init__(self, path: str | Path, upstream: str | Path = "/var/run/docker.sock") -> None:
        self.path = str(path)
        self.upstream = str(upstream)
        self.url = f"unix://{self.path}"
        self.seen: list[str] = []  # "<METHOD> <path>" of every request forwarded or held
        self.held = 0
        self._held_changed = threading.Condition()  # notified whenever `held` changes
        self._rules: tuple[_Rule, ...] = ()
        self._drop_generation = 0
        # The held requests' drop signals, with the drop generation each began in.
        self._holds: dict[asyncio.Future[None], int] = {}
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="docker-proxy", daemon=True
        )
        self._thread.start()

    # --- control, from the test's thread ----------------------------------------------

    def start(self) -> DockerProxy:
        self._call(self._start())
        return self

    def stop(self) -> None:
        """Refuse connections and cut every open one, as if the engine were gone."""
        self._call(self._stop())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            self.drop_held()
            self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()
        with contextlib.suppress(FileNotFoundError):
            Path(self.path).unlink()

    def delay(self, pattern: str, seconds: float) -> None:
        """Hold requests whose "<METHOD> <path>" matches `pattern` (re.search)."""
        self._rules = (*self._rules, _Rule(re.compile(pattern), seconds))

    def clear(self) -> None:
        """No more faults for new requests (requests already held stay held)."""
        self._rules = ()

    def drop_held(self) -> None:
        """Close the connections of all held requests without forwarding them."""
        self._drop_generation += 1
        self._loop.call_soon_threadsafe(self._drop, self._drop_generation)

    def wait_held(self, count: int, timeout: float) -> None:
        with self._held_changed:
            if not self._held_changed.wait_for(lambda: self.held == count, timeout):
                raise AssertionError(
                    f"proxy holds {self.held} requests, not {count}, "
                    f"after {timeout}s; seen: {self.seen[-10:]}"
                )

    def __enter__(self) -> DockerProxy:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    # --- the loop's side --------------------------------------------------------------

    async def _start(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_unix_server(
                self._serve, self.path, limit=_HEAD_LIMIT
            )

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._writers.add(client_w)
        upstream_w: asyncio.StreamWriter | None = None
        pipe: asyncio.Task[None] | None = None
        try:
            try:
                upstream_r, upstream_w = await asyncio.open_unix_connection(
                    self.upstream, limit=_HEAD_LIMIT
                )
            except OSError:
                return  # the engine itself is down: the client sees the connection close
            self._writers.add(upstream_w)
            pipe = asyncio.create_task(self._pipe(upstream_r, client_w))
            early = b""  # what a client sent while its request was held: sent on after it
            while True:
                try:
                    head = early + await client_r.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                early = b""
                method, target, headers = _parse_head(head)
                what = f"{method} {target}"
                self.seen.append(what)
                rule = next((r for r in self._rules if r.pattern.search(what)), None)
                upgrade = "upgrade" in headers.get("connection", "").lower()
                if rule is None:
                    upstream_w.write(head)
                    await self._forward_body(client_r, upstream_w, headers)
                else:
                    body = _Buffer()
                    await self._forward_body(client_r, body, headers)
                    forward, early = await self._hold(rule, client_r)
                    if not forward:
                        return
                    upstream_w.write(head + body.data)
                    if upgrade:
                        upstream_w.write(early)
                await upstream_w.drain()
                if upgrade:
                    await self._pipe(client_r, upstream_w)  # hijacked: raw from now on
                    return
        except ConnectionError:
            return
        finally:
            for writer in (client_w, upstream_w):
                if writer is not None:
                    self._writers.discard(writer)
                    writer.transport.abort()
            if pipe is not None:
                pipe.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pipe

    async def _hold(self, rule: _Rule, client_r: asyncio.StreamReader) -> tuple[bool, bytes]:
        """Wait out the delay (the request read whole): whether to forward it, and what
        its client sent meanwhile. Not forwarded when dropped (`drop_held`), or when its
        client left: the client waits for an answer, so a read returns only at its end
        (or with data it sends early, kept)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + rule.seconds
        dropped: asyncio.Future[None] = loop.create_future()
        self._holds[dropped] = self._drop_generation
        left = asyncio.ensure_future(client_r.read(1))
        forward = True
        self._count_held(+1)
        try:
            waiting: set[asyncio.Future[Any]] = {dropped, left}
            while (remaining := deadline - loop.time()) > 0:
                done, _ = await asyncio.wait(
                    waiting, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                if dropped in done:
                    forward = False
                    break
                if left in done:
                    waiting.discard(left)
                    if not left.result():
                        forward = False  # the client is gone: never forward it
                        break
        finally:
            self._count_held(-1)
            del self._holds[dropped]
            if not left.done():
                left.cancel()
                await asyncio.wait([left])  # settled before the stream is read again
        return forward, b"" if left.cancelled() else left.result()

    def _drop(self, generation: int) -> None:
        for dropped, began in self._holds.items():
            if began < generation and not dropped.done():
                dropped.set_result(None)

    def _count_held(self, change: int) -> None:
        with self._held_changed:
            self.held += change
            self._held_changed.notify_all()

    async def _forward_body(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter | _Buffer,
        headers: dict[str, str],
    ) -> None:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readuntil(b"\r\n")
                writer.write(size_line)
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while True:  # trailers, up to the empty line
                        line = await reader.readuntil(b"\r\n")
                        writer.write(line)
                        if line == b"\r\n":
                            return
                writer.write(await reader.readexactly(size + 2))
                await writer.drain()
        remaining = int(headers.get("content-length", "0") or 0)
        while remaining > 0:
            chunk = await reader.readexactly(min(remaining, _CHUNK))
            writer.write(chunk)
            remaining -= len(chunk)
            await writer.drain()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.transport.abort()


class _Buffer:
    """A held request's body, read before its hold (a writer to `_forward_body`)."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    method, target, *_ = (lines[0].split(" ") + ["", ""])[:3]
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    return method, target, headers
