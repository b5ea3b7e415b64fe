"""Whether the caller of a request is still there: a caller that hangs up while waiting
in line or provisioning must get no worker.

The server tells the app (`http.disconnect`), except in one case: a request pipelined
behind this one on its connection. uvicorn then stops reading the connection until this
answer is sent (both its h11 and httptools protocols, and no setting changes that), so it
cannot see the caller leave. For that case the connection's TCP state is asked of the
kernel (Linux `/proc/net/tcp`, see proc(5)): a caller that closed its socket has sent a
FIN, and the connection is no longer ESTABLISHED. Elsewhere (no /proc) only the server's
notice counts.

The kernel's table lists every socket of the host, so it is read once per look for every
request being watched, in a thread, by one watch of the whole process (`Watch`): each
waiting request costs a dictionary lookup per look, not a read of the table (with 1,000
callers in line and thousands of sockets, a read each pinned the event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from starlette.types import Receive, Scope

# How often the kernel is asked, while any request is watched; a quick acquire never is.
POLL_S = 0.5
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"


async def watch_hangup(scope: Scope, receive: Receive, gone: asyncio.Event) -> None:
    """Set `gone` when the caller hangs up. Called once the body is read, so the next
    message from the server is the caller going away. Cancel it when the call is over."""
    with WATCH.watching(scope, gone):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                return


@dataclass(eq=False)
class _Watched:
    gone: asyncio.Event
    missing: int = 0


class Watch:
    """The connections of the requests being watched, by (local, remote) address as the
    kernel writes them, looked up in one read of its table every POLL_S."""

    def __init__(self) -> None:
        self._watched: dict[tuple[str, str], list[_Watched]] = {}
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def watching(self, scope: Scope, gone: asyncio.Event) -> Iterator[None]:
        key = _key(scope)
        if key is None or not _readable():
            yield  # not TCP, or no /proc: the server's notice alone
            return
        entry = _Watched(gone)
        self._watched.setdefault(key, []).append(entry)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="hang-up watch")
        try:
            yield
        finally:
            entries = self._watched.get(key, [])
            with contextlib.suppress(ValueError):
                entries.remove(entry)
            if not entries:
                self._watched.pop(key, None)

    async def _run(self) -> None:
        while self._watched:
            await asyncio.sleep(POLL_S)
            states = await asyncio.to_thread(_states)
            for key, entries in list(self._watched.items()):
                state = states.get(key, "")
                for entry in entries:
                    # Not listed at all: closed, unless the read raced a change; ask twice.
                    entry.missing = entry.missing + 1 if state == "" else 0
                    if state not in ("", _ESTABLISHED) or entry.missing >= 2:
                        entry.gone.set()


WATCH = Watch()


def _key(scope: Scope) -> tuple[str, str] | None:
    server, client = scope.get("server"), scope.get("client")
    if not (server and client and isinstance(server[1], int) and isinstance(client[1], int)):
        return None
    try:
        return _address(*server), _address(*client)
    except OSError:
        return None


@functools.cache
def _readable() -> bool:
    """Whether the kernel's tables can be read here (Linux with /proc), once."""
    return any(_can_open(table) for table in _TABLES)


def _can_open(path: str) -> bool:
    try:
        with open(path):
            return True
    except OSError:
        return False


def _states() -> dict[tuple[str, str], str]:
    """Every TCP connection the kernel lists: (local, remote) → state."""
    found: dict[tuple[str, str], str] = {}
    for table in _TABLES:
        try:
            with open(table) as rows:
                next(rows, None)  # the heading
                for row in rows:
                    fields: list[Any] = row.split(None, 4)
                    found[(fields[1], fields[2])] = fields[3]
        except OSError:
            continue
    return found


def _address(host: str, port: int) -> str:
    """`host:port` as /proc/net/tcp writes it: the address as native 32-bit words in hex."""
    if ":" in host:
        words = struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, host))
        return "".join(f"{word:08X}" for word in words) + f":{port:04X}"
    (word,) = struct.unpack("=I", socket.inet_aton(host))
    return f"{word:08X}:{port:04X}"
