"""What the suite's emulators of clouds (k8s_emulator/, modal_emulator/,
runpod_emulator/) share as servers, whether one runs in the test's process or as a
process of its own (emulator_process.py): the loopback address they serve on, a
listening socket bound before serving, an aiohttp app served until a block ends, the
control API's plumbing (`GET /_emulator/healthz`, a JSON body), and `with` for a handle
that starts and stops its emulator (`Served`)."""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any, Self

from aiohttp import web

LOOPBACK = "127.0.0.1"


def loopback_socket(port: int) -> socket.socket:
    """A TCP socket bound to `port` on loopback (0: any free one), for a server to listen
    on: bound before the server starts, so that its port is known (`getsockname()`)
    without a race, also when it was 0."""
    # proto must be IPPROTO_TCP, not 0: asyncio only sets TCP_NODELAY on such sockets, and
    # without it every answer waits ~40 ms on Nagle + delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    return sock


@contextlib.asynccontextmanager
async def serving(
    app: web.Application, port: int, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    """Serve `app` on loopback at `port` (0: any free one; HTTPS with `ssl_context`)
    until the block ends; yields the port it listens on."""
    runner = web.AppRunner(app, access_log=None)
    try:
        await runner.setup()
        await web.TCPSite(runner, LOOPBACK, port, ssl_context=ssl_context).start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


# --- the control API -----------------------------------------------------------------------


def control_app(routes: web.RouteTableDef) -> web.Application:
    """An emulator's control API (plain HTTP, JSON: the tests' hands, not the client's
    traffic): `routes`, and `GET /_emulator/healthz`, which answers 200 once the emulator
    serves (`EmulatorProcess` asks it before a test goes on)."""
    app = web.Application()
    app.router.add_get("/_emulator/healthz", _healthz)
    app.add_routes(routes)
    return app


async def _healthz(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def read_json(request: web.Request) -> Any:
    """The request's body as JSON; 400 when it is not JSON (an empty body is not)."""
    try:
        return await request.json()
    except ValueError as exc:
        raise web.HTTPBadRequest(text=f"not JSON: {exc}") from exc


# --- the test's handle -----------------------------------------------------------------


class Served:
    """A handle on an emulator that `start()`s it (answering the handle, once it serves)
    and `stop()`s it; `with handle:` does both."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
