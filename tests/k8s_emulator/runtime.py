"""The kubelet's container runtime: the local Docker engine, blocking docker SDK calls
(the kubelet runs them in threads).

Every container carries the emulator instance's label and its pod's namespace, name and
uid, so that everything the emulator made is found and removed by label, also after a
crash. A container's end is heard from Docker's event stream (`die`), read in a thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import docker
import docker.errors

LABEL_INSTANCE = "openalice.k8s-emulator.instance"
LABEL_NAMESPACE = "openalice.k8s-emulator.pod-namespace"
LABEL_POD = "openalice.k8s-emulator.pod"
LABEL_UID = "openalice.k8s-emulator.pod-uid"
_DOCKER_TIMEOUT = 120


class Runtime:
    def __init__(self, instance: str, network: str | None) -> None:
        self.instance = instance
        self.network = network
        self._client = docker.from_env(timeout=_DOCKER_TIMEOUT)
        self._network_made = False
        self._events: Any = None

    def ensure_network(self) -> None:
        if self.network is None:
            return
        try:
            self._client.networks.get(self.network)
        except docker.errors.NotFound:
            self._client.networks.create(
                self.network, driver="bridge", labels={LABEL_INSTANCE: self.instance}
            )
            self._network_made = True

    def host_ip(self) -> str:
        """The node's address: the host's on the pods' network (its gateway)."""
        network = self._client.networks.get(self.network or "bridge")
        configs = network.attrs.get("IPAM", {}).get("Config") or [{}]
        return str(configs[0].get("Gateway") or "127.0.0.1")

    def image_exists(self, reference: str) -> bool:
        try:
            self._client.images.get(reference)
        except docker.errors.ImageNotFound:
            return False
        return True

    def run(
        self,
        pod: dict[str, Any],
        env: dict[str, str],
    ) -> tuple[str, str, str]:
        """Create and start the pod's (first) container: (id, image id, IP on the network)."""
        meta, container = pod["metadata"], pod["spec"]["containers"][0]
        options: dict[str, Any] = {
            "image": container["image"],
            "environment": env,  # the container's config, never a command line
            "labels": {
                LABEL_INSTANCE: self.instance,
                LABEL_NAMESPACE: meta["namespace"],
                LABEL_POD: meta["name"],
                LABEL_UID: meta["uid"],
            },
            "name": f"k8s-emu-{self.instance}-{meta['namespace']}-{meta['name']}"[:120],
            "hostname": meta["name"][:63],
            "detach": True,
            "network": self.network,
            "working_dir": container.get("workingDir"),
        }
        if container.get("command"):
            options["entrypoint"] = container["command"]  # Docker then drops the image's CMD
        if container.get("args"):
            options["command"] = container["args"]
        created = self._client.containers.create(**options)
        try:
            created.start()
            created.reload()
            networks = created.attrs["NetworkSettings"]["Networks"]
            address = networks[self.network or "bridge"]["IPAddress"]
        except Exception:
            self.remove(created.id)
            raise
        return str(created.id), str(created.attrs.get("Image", "")), str(address)

    def stop(self, container_id: str, grace: int) -> None:
        """`docker stop -t grace`: SIGTERM, SIGKILL after `grace` seconds."""
        with contextlib.suppress(docker.errors.NotFound):
            self._client.api.stop(container_id, timeout=grace)

    def remove(self, container_id: str) -> None:
        try:
            self._client.api.remove_container(container_id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if "already in progress" not in str(exc):
                raise

    def exit_code(self, container_id: str) -> tuple[int, str, str] | None:
        """(exit code, started at, finished at) of a container that has ended."""
        try:
            state = self._client.api.inspect_container(container_id)["State"]
        except docker.errors.NotFound:
            return None
        if state.get("Running"):
            return None
        return int(state.get("ExitCode", -1)), state["StartedAt"], state["FinishedAt"]

    def containers(self) -> list[dict[str, Any]]:
        found = self._client.api.containers(
            all=True, filters={"label": f"{LABEL_INSTANCE}={self.instance}"}
        )
        return [
            {
                "id": entry["Id"],
                "name": entry["Names"][0].lstrip("/") if entry.get("Names") else "",
                "pod": entry["Labels"].get(LABEL_POD),
                "namespace": entry["Labels"].get(LABEL_NAMESPACE),
                "uid": entry["Labels"].get(LABEL_UID),
                "image": entry.get("Image"),
                "state": entry.get("State"),
            }
            for entry in found
        ]

    def remove_all(self) -> int:
        found = self.containers()
        for entry in found:
            self.remove(entry["id"])
        return len(found)

    def watch_exits(self, on_exit: Callable[[str, str, int], None]) -> None:
        """Call `on_exit(pod uid, container id, exit code)` (from a thread) as containers end."""
        self._events = docker.from_env(timeout=None).events(
            decode=True,
            filters={
                "type": "container",
                "event": "die",
                "label": f"{LABEL_INSTANCE}={self.instance}",
            },
        )

        def read() -> None:
            try:
                for event in self._events:
                    actor = event.get("Actor", {})
                    attributes = actor.get("Attributes", {})
                    uid = attributes.get(LABEL_UID)
                    if uid:
                        on_exit(uid, actor.get("ID", ""), int(attributes.get("exitCode", "-1")))
            except Exception:  # noqa: BLE001 - the stream was closed at shutdown
                return

        threading.Thread(target=read, name="docker-events", daemon=True).start()

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
        self.remove_all()
        if self._network_made and self.network is not None:
            with contextlib.suppress(docker.errors.APIError):
                self._client.networks.get(self.network).remove()
        self._client.close()
