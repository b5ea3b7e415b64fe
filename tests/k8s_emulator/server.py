"""The emulator process's parts put together: the Kubernetes API over HTTPS (a CA of its
own, from tests/modal_emulator/tls.py), the control API over plain HTTP, the store and
the test kubelet with its Docker runtime."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.modal_emulator.tls import make_certificates

from .access import DEFAULT_USER, Access
from .api import make_api_app
from .control import make_control_app
from .kubelet import Kubelet
from .runtime import Runtime
from .scheduling import validate_nodes
from .store import Store

LOOPBACK = "127.0.0.1"
log = logging.getLogger("k8s_emulator")


@dataclass
class EmulatorConfig:
    instance: str
    token: str
    state_dir: Path
    network: str | None = None
    port: int = 0
    control_port: int = 0
    user: str = DEFAULT_USER
    namespaces: list[str] = field(default_factory=list)
    nodes: list[dict[str, Any]] | None = None
    rbac: list[dict[str, Any]] | None = None


async def serve(
    config: EmulatorConfig, ready: Callable[[dict[str, Any]], None], stop: asyncio.Event
) -> None:
    certificates = make_certificates(config.state_dir / "tls", [LOOPBACK])
    store = Store(config.namespaces)
    runtime = Runtime(config.instance, config.network)
    kubelet = Kubelet(store, runtime)
    if config.nodes is not None:
        kubelet.nodes = validate_nodes(config.nodes)
    access = Access(token=config.token, user=config.user, rules=config.rbac)
    await kubelet.start()
    api = web.AppRunner(make_api_app(store, kubelet, access), access_log=None)
    control = web.AppRunner(make_control_app(store, kubelet, access), access_log=None)
    try:
        await api.setup()
        await control.setup()
        tls = certificates.server_context(["http/1.1"])
        await web.TCPSite(api, LOOPBACK, config.port, ssl_context=tls).start()
        await web.TCPSite(control, LOOPBACK, config.control_port).start()
        port, control_port = api.addresses[0][1], control.addresses[0][1]
        ready(
            {
                "server_url": f"https://{LOOPBACK}:{port}",
                "control_url": f"http://{LOOPBACK}:{control_port}",
                "ca_file": str(certificates.ca_file),
                "instance": config.instance,
                "network": config.network,
                "host_ip": kubelet.host_ip,
                "user": config.user,
            }
        )
        await stop.wait()
    finally:
        # Open watches end first: a watch whose client was killed waits for its next
        # event, and would hold the shutdown (aiohttp waits for its handlers) until the
        # test's stop timeout kills the process.
        store.end_watches()
        await api.cleanup()
        await control.cleanup()
        await kubelet.close()
