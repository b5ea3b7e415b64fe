"""The emulator process's parts put together: the Kubernetes API over HTTPS (a CA of its
own, from tests/modal_emulator/tls.py), the control API over plain HTTP, the store and
the test kubelet with its Docker runtime."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.emulator_common import LOOPBACK, serving
from tests.emulator_process import ServerConfig
from tests.modal_emulator.tls import make_certificates

from .access import DEFAULT_USER, Access
from .api import make_api_app
from .control import make_control_app
from .kubelet import Kubelet
from .runtime import Runtime
from .scheduling import validate_nodes
from .store import Store

log = logging.getLogger("k8s_emulator")


@dataclass(kw_only=True)
class EmulatorConfig(ServerConfig):
    token: str
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
    tls = certificates.server_context(["http/1.1"])
    try:
        async with (
            serving(make_api_app(store, kubelet, access), config.port, tls) as port,
            serving(make_control_app(store, kubelet, access), config.control_port) as control_port,
        ):
            try:
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
                # Open watches end first: a watch whose client was killed waits for its
                # next event, and would hold the shutdown (aiohttp waits for its handlers)
                # until the test's stop timeout kills the process.
                store.end_watches()
    finally:
        await kubelet.close()
