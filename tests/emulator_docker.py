"""What the suite's emulators of clouds (modal_emulator/, k8s_emulator/) share on the
Docker side: an emulator instance's containers on the local engine and one network, all
labelled with the instance (`label=instance`), so that everything it made is found and
removed by label, also after a crash. Blocking docker SDK calls: the emulators run them
in threads. A container's end is heard from Docker's event stream (`die`), read in a
thread of its own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import docker
import docker.errors


class InstanceContainers:
    def __init__(self, label: str, instance: str, network: str | None, timeout: int) -> None:
        self.label = label
        self.instance = instance
        self.network = network
        self._client = docker.from_env(timeout=timeout)
        self._network_made = False
        self._events: Any = None

    @property
    def selector(self) -> str:
        """The label filter of this instance's containers and network."""
        return f"{self.label}={self.instance}"

    def ensure_network(self) -> None:
        """Use the network if it exists, else make it (and remove it at close)."""
        if self.network is None:
            return
        try:
            self._client.networks.get(self.network)
        except docker.errors.NotFound:
            self._client.networks.create(
                self.network, driver="bridge", labels={self.label: self.instance}
            )
            self._network_made = True

    def gateway(self) -> str | None:
        """The host's address on the network: how a container reaches a server on the
        host."""
        network = self._client.networks.get(self.network or "bridge")
        configs = network.attrs.get("IPAM", {}).get("Config") or [{}]
        gateway = configs[0].get("Gateway")
        return str(gateway) if gateway else None

    def image_exists(self, reference: str) -> bool:
        try:
            self._client.images.get(reference)
        except docker.errors.ImageNotFound:
            return False
        return True

    def remove(self, container_id: str) -> None:
        """Kill (SIGKILL) and remove; a container already gone is fine."""
        try:
            self._client.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if "already in progress" not in str(exc):
                raise

    def listed(self) -> list[dict[str, Any]]:
        """Every container of this instance, as Docker lists them."""
        return list(self._client.api.containers(all=True, filters={"label": self.selector}))

    def remove_all(self) -> int:
        """Remove every container of this instance (by label); how many there were."""
        found = self.listed()
        for entry in found:
            self.remove(entry["Id"])
        return len(found)

    def watch_dies(self, on_die: Callable[[dict[str, str], str, int], None]) -> None:
        """Call `on_die(labels, container id, exit code)` (from a thread) as containers of
        this instance end."""
        self._events = docker.from_env(timeout=None).events(
            decode=True,
            filters={"type": "container", "event": "die", "label": self.selector},
        )

        def read() -> None:
            try:
                for event in self._events:
                    actor = event.get("Actor", {})
                    attributes = actor.get("Attributes", {})
                    on_die(attributes, actor.get("ID", ""), int(attributes.get("exitCode", "-1")))
            except Exception:  # noqa: BLE001 - the stream was closed at shutdown
                return

        threading.Thread(target=read, name="docker-events", daemon=True).start()

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        self.remove_all()
        if self._network_made and self.network is not None:
            # Still in use by someone else's container: left as it is.
            with contextlib.suppress(docker.errors.APIError):
                self._client.networks.get(self.network).remove()
        self._client.close()
