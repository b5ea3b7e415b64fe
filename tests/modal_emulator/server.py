"""The emulator process's parts put together: the gRPC server the `modal` client talks
to (`grpclib`, plain HTTP/2 on loopback: `MODAL_SERVER_URL=http://127.0.0.1:<port>`),
the control API, the sandbox engine with its containers and tunnels, and the CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import grpclib.server

from tests.emulator_common import LOOPBACK, loopback_socket, serving
from tests.emulator_process import ServerConfig

from .auth import Credentials
from .containers import Containers
from .control import make_control_app
from .engine import SandboxEngine
from .servicer import ModalServicer
from .state import EmulatorState
from .tls import make_certificates
from .version import CHECKED_CLIENT_VERSION

_CLOSE_TIMEOUT = 3.0
log = logging.getLogger("modal_emulator")


@dataclass(kw_only=True)
class EmulatorConfig(ServerConfig):
    token_id: str
    token_secret: str
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
    try:
        sock = loopback_socket(config.port)
        port = sock.getsockname()[1]
        await server.start(sock=sock)
        async with serving(make_control_app(state, engine), config.control_port) as control_port:
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
        await engine.close()
