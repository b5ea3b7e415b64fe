"""The emulator process's parts put together: the gRPC server the `modal` client talks
to (`grpclib`, plain HTTP/2 on loopback: `MODAL_SERVER_URL=http://127.0.0.1:<port>`),
the control API, the sandbox engine with its containers and tunnels, and the CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import grpclib.server
from aiohttp import web

from .auth import Credentials
from .containers import Containers
from .control import make_control_app
from .engine import SandboxEngine
from .servicer import ModalServicer
from .state import EmulatorState
from .tls import make_certificates
from .version import CHECKED_CLIENT_VERSION

LOOPBACK = "127.0.0.1"
_CLOSE_TIMEOUT = 3.0
log = logging.getLogger("modal_emulator")


@dataclass
class EmulatorConfig:
    instance: str
    token_id: str
    token_secret: str
    state_dir: Path
    network: str | None = None
    port: int = 0
    control_port: int = 0
    tunnel_host: str = LOOPBACK
    tunnel_bind: str = LOOPBACK
    client_versions: frozenset[str] = frozenset({CHECKED_CLIENT_VERSION})


async def serve(
    config: EmulatorConfig, ready: Callable[[dict[str, Any]], None], stop: asyncio.Event
) -> None:
    """Serve until `stop` is set; `ready(info)` once everything answers. On the way out,
    every container of the instance is removed (by label), and its network if it made it."""
    installed = metadata.version("modal")
    if installed not in config.client_versions:
        raise SystemExit(
            f"modal {installed} is installed, the emulator was checked against "
            f"{CHECKED_CLIENT_VERSION} (tests/modal_emulator/README.md, Upgrading modal)"
        )
    certificates = make_certificates(config.state_dir / "tls", [config.tunnel_host])
    state = EmulatorState(config.token_id, config.token_secret)
    containers = Containers(config.instance, config.network, config.state_dir)
    engine = SandboxEngine(
        state,
        containers,
        certificates,
        tunnel_host=config.tunnel_host,
        tunnel_bind=config.tunnel_bind,
    )
    await engine.start()
    # Not abstract: servicer.py fills the RPCs it does not emulate (UNIMPLEMENTED).
    servicer = ModalServicer(  # type: ignore[abstract]
        state, engine, Credentials(config.token_id, config.token_secret), config.client_versions
    )
    server = grpclib.server.Server([servicer])
    runner = web.AppRunner(make_control_app(state, engine), access_log=None)
    try:
        # Bound here, so that the port is known also when it was 0.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, config.port))
        port = sock.getsockname()[1]
        await server.start(sock=sock)
        await runner.setup()
        site = web.TCPSite(runner, LOOPBACK, config.control_port)
        await site.start()
        control_port = runner.addresses[0][1]
        ready(
            {
                "server_url": f"http://{LOOPBACK}:{port}",
                "control_url": f"http://{LOOPBACK}:{control_port}",
                "ca_file": str(certificates.ca_file),
                "token_id": config.token_id,
                "instance": config.instance,
                "network": config.network,
                "network_gateway": await asyncio.to_thread(containers.gateway),
            }
        )
        await stop.wait()
    finally:
        server.close()
        # Long polls (SandboxWait holds a call up to 55 s) are not waited for.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), _CLOSE_TIMEOUT)
        await runner.cleanup()
        await engine.close()
