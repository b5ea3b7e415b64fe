"""Whether the caller of a request is still there: a caller that hangs up while waiting
in line or provisioning must get no worker.

The server tells the app (`http.disconnect`), except in one case: a request pipelined
behind this one on its connection, with uvicorn's httptools protocol (`HTTP_PARSER`). It
then stops reading the connection until this answer is sent, so it cannot see the caller
leave (its h11 protocol, the default, now tells). For that case the kernel is asked the
connection's TCP state (Linux's sock_diag netlink interface, sock_diag(7)): a caller that
closed its socket has sent a FIN, and the connection is no longer ESTABLISHED. Where the
kernel does not answer so (no sock_diag, or no tcp_diag in it: checked once, on a
connection of the process's own) only the server's notice counts.

The connection is looked up by its addresses, one exact request each (tens of
microseconds, whatever else the host holds), every POLL_S, in a thread, by one watch of
the whole process (`Watch`) for every request being watched. It used to be read from
/proc/net/tcp, which the kernel writes by walking its whole connection table: ~9 ms of
CPU a read on a host with 24 GB whose table was nearly empty, twice a second while
anybody waited."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import struct
from collections.abc import Iterator

from starlette.types import Receive, Scope

# How often the kernel is asked, while any request is watched; a quick acquire never is.
POLL_S = 0.5
# linux/sock_diag.h, linux/inet_diag.h, linux/netlink.h, linux/tcp_states.h.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NO_COOKIE = 0xFFFFFFFF
_ALL_STATES = 0xFFFFFFFF
_ESTABLISHED = 1
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port


async def watch_hangup(scope: Scope, receive: Receive, gone: asyncio.Event) -> None:
    """Set `gone` when the caller hangs up. Called once the body is read, so the next
    message from the server is the caller going away. Cancel it when the call is over."""
    with WATCH.watching(scope, gone):
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
                return


# A connection as the kernel knows it: its family, then its local and remote address and
# port, the addresses packed as sock_diag takes them.
Key = tuple[int, bytes, int, bytes, int]


class Watch:
    """The connections of the requests being watched, each looked up every POLL_S."""

    def __init__(self) -> None:
        self._watched: dict[Key, list[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def watching(self, scope: Scope, gone: asyncio.Event) -> Iterator[None]:
        key = _key(scope)
        if key is None or not _available():
            yield  # not TCP, or no sock_diag: the server's notice alone
            return
        self._watched.setdefault(key, []).append(gone)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="hang-up watch")
        try:
            yield
        finally:
            events = self._watched.get(key, [])
            with contextlib.suppress(ValueError):
                events.remove(gone)
            if not events:
                self._watched.pop(key, None)

    async def _run(self) -> None:
        while self._watched:
            await asyncio.sleep(POLL_S)
            keys = list(self._watched)
            established = await asyncio.to_thread(_established, keys)
            for key, there in zip(keys, established, strict=True):
                if not there:
                    for gone in self._watched.get(key, []):
                        gone.set()


WATCH = Watch()


def _key(scope: Scope) -> Key | None:
    server, client = scope.get("server"), scope.get("client")
    if not (server and client and isinstance(server[1], int) and isinstance(client[1], int)):
        return None
    return _connection(server, client)


def _connection(local: tuple[str, int], remote: tuple[str, int]) -> Key | None:
    """The connection from `local` to `remote` (host, port), as sock_diag looks it up."""
    family = socket.AF_INET6 if ":" in local[0] else socket.AF_INET
    try:
        packed = [socket.inet_pton(family, host) for host, _ in (local, remote)]
    except OSError:
        return None
    return family, packed[0], local[1], packed[1], remote[1]


@functools.cache
def _available() -> bool:
    """Whether the kernel answers sock_diag here, asked once, of a loopback connection of
    this process's own: it must be seen ESTABLISHED. (A kernel without its tcp_diag
    module answers every lookup "not found", which would make every caller gone.)"""
    try:
        with (
            socket.create_server(("127.0.0.1", 0)) as server,
            socket.create_connection(server.getsockname()) as client,
        ):
            key = _connection(client.getsockname(), client.getpeername())
            return key is not None and _established([key]) == [True]
    except (OSError, AttributeError):  # not Linux (no AF_NETLINK), or not allowed
        return False


def _established(keys: list[Key]) -> list[bool]:
    """For each connection, whether it is still ESTABLISHED: one exact lookup each
    (SOCK_DIAG_BY_FAMILY without NLM_F_DUMP). A connection that is gone is answered with
    an error, or with the listening socket of its port: not ESTABLISHED either way."""
    answers = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as diag:
        for sequence, (family, local, local_port, remote, remote_port) in enumerate(keys, 1):
            # inet_diag_req_v2, whose inet_diag_sockid has ports and addresses in network
            # order, each address in 16 bytes (IPv4 in the first 4).
            request = (
                struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES)
                + struct.pack("!HH16s16s", local_port, remote_port, local, remote)
                + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
            )
            diag.send(
                _HEADER.pack(
                    _HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, sequence, 0
                )
                + request
            )
            answer = diag.recv(65536)
            kind = _HEADER.unpack_from(answer)[1]
            # inet_diag_msg: family, then the state.
            answers.append(kind != _NLMSG_ERROR and answer[_HEADER.size + 1] == _ESTABLISHED)
    return answers
