"""Whether the caller of a request is still there: a caller that hangs up while waiting
in line or provisioning must get no worker.

The server tells the app (`http.disconnect`), except in one case: a request pipelined
behind this one on its connection. uvicorn then stops reading the connection until this
answer is sent (both its h11 and httptools protocols, and no setting changes that), so it
cannot see the caller leave. For that case the connection's TCP state is asked of the
kernel (Linux `/proc/net/tcp`, see proc(5)): a caller that closed its socket has sent a
FIN, and the connection is no longer ESTABLISHED. Elsewhere (no /proc) only the server's
notice counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

from starlette.types import Receive, Scope

# How often a waiting request asks the kernel; a quick acquire never does.
POLL_S = 0.5
_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"


async def watch_hangup(scope: Scope, receive: Receive, gone: asyncio.Event) -> None:
    """Set `gone` when the caller hangs up. Called once the body is read, so the next
    message from the server is the caller going away. Cancel it when the call is over."""
    message: asyncio.Future[Any] = asyncio.ensure_future(receive())
    missing = 0
    try:
        while True:
            done, _ = await asyncio.wait([message], timeout=POLL_S)
            if done:
                if message.result()["type"] == "http.disconnect":
                    gone.set()
                    return
                message = asyncio.ensure_future(receive())
                continue
            state = connection_state(scope)
            # Not listed at all: closed, unless the listing raced a change; ask twice.
            missing = missing + 1 if state == "" else 0
            if (state is not None and state not in ("", _ESTABLISHED)) or missing >= 2:
                gone.set()
                return
    finally:
        message.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await message


def connection_state(scope: Scope) -> str | None:
    """The kernel's TCP state of the request's connection (`01` established, `08`
    close-wait...), "" when no such connection is listed, None when unknown (no /proc,
    not TCP)."""
    server, client = scope.get("server"), scope.get("client")
    if not (server and client and isinstance(server[1], int) and isinstance(client[1], int)):
        return None
    try:
        local, remote = _address(*server), _address(*client)
    except OSError:
        return None
    read_any = False
    for table in _TABLES:
        try:
            with open(table) as rows:
                read_any = True
                next(rows, None)  # the heading
                for row in rows:
                    fields = row.split(None, 4)
                    if fields[1] == local and fields[2] == remote:
                        return fields[3]
        except OSError:
            continue
    return "" if read_any else None


def _address(host: str, port: int) -> str:
    """`host:port` as /proc/net/tcp writes it: the address as native 32-bit words in hex."""
    if ":" in host:
        words = struct.unpack("=4I", socket.inet_pton(socket.AF_INET6, host))
        return "".join(f"{word:08X}" for word in words) + f":{port:04X}"
    (word,) = struct.unpack("=I", socket.inet_aton(host))
    return f"{word:08X}:{port:04X}"
