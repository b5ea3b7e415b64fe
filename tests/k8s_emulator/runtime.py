"""The kubelet's container runtime: the local Docker engine, blocking docker SDK calls
(the kubelet runs them in threads).

Every container carries the emulator instance's label and its pod's namespace, name and
uid, so that everything the emulator made is found and removed by label, also after a
crash. A container's end is heard from Docker's event stream (`die`), read in a thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import docker.errors

from tests.emulator_docker import InstanceContainers

from .scheduling import quantity

LABEL_INSTANCE = "openalice.k8s-emulator.instance"
LABEL_NAMESPACE = "openalice.k8s-emulator.pod-namespace"
LABEL_POD = "openalice.k8s-emulator.pod"
LABEL_UID = "openalice.k8s-emulator.pod-uid"


@dataclass(frozen=True)
class Exit:
    """How a container ended, as the engine tells it (`docker inspect`'s State)."""

    code: int
    started: str | None
    finished: str | None
    oom_killed: bool


class Runtime(InstanceContainers):
    def __init__(self, instance: str, network: str | None) -> None:
        super().__init__(LABEL_INSTANCE, instance, network, timeout=120)

    def host_ip(self) -> str:
        """The node's address: the host's on the pods' network (its gateway)."""
        return self.gateway() or "127.0.0.1"

    def image_user(self, reference: str) -> str:
        """The user the image's config runs as (`docker image inspect`'s Config.User;
        empty: root)."""
        return str((self._client.images.get(reference).attrs.get("Config") or {}).get("User") or "")

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
        memory = ((container.get("resources") or {}).get("limits") or {}).get("memory")
        if memory is not None:
            # The container's memory limit is its cgroup's, as the kubelet sets it; no swap
            # (the kubelet's default): past it the kernel's OOM killer ends the container
            # (https://kubernetes.io/docs/tasks/configure-pod-container/assign-memory-resource/).
            options["mem_limit"] = options["memswap_limit"] = int(quantity(memory))
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

    def kill(self, container_id: str) -> None:
        """`docker kill` (SIGKILL, as the kernel's OOM killer sends), then wait until the
        container has ended."""
        with contextlib.suppress(docker.errors.NotFound):
            with contextlib.suppress(docker.errors.APIError):  # ended meanwhile
                self._client.api.kill(container_id, signal="SIGKILL")
            self._client.api.wait(container_id, timeout=60)

    def exit_info(self, container_id: str) -> Exit | None:
        """How a container that has ended did (None: still running, or gone)."""
        try:
            state = self._client.api.inspect_container(container_id)["State"]
        except docker.errors.NotFound:
            return None
        if state.get("Running"):
            return None
        return Exit(
            code=int(state.get("ExitCode", -1)),
            started=state.get("StartedAt"),
            finished=state.get("FinishedAt"),
            oom_killed=bool(state.get("OOMKilled")),
        )

    def memory_working_set(self, container_id: str) -> int | None:
        """The container's memory working set in bytes (usage less inactive file pages,
        as cAdvisor counts it for the kubelet), or None if the engine has none."""
        try:
            stats = self._client.api.stats(container_id, stream=False, one_shot=True)
        except docker.errors.APIError:
            return None
        memory = stats.get("memory_stats") or {}
        if "usage" not in memory:
            return None
        detail = memory.get("stats") or {}
        inactive = detail.get("total_inactive_file", detail.get("inactive_file", 0))
        return max(int(memory["usage"]) - int(inactive), 0)

    def containers(self) -> list[dict[str, Any]]:
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
            for entry in self.listed()
        ]

    def watch_exits(self, on_exit: Callable[[str, str, int, bool], None]) -> None:
        """Call `on_exit(pod uid, container id, exit code, OOM-killed)` (from a thread) as
        containers end."""

        def heard(labels: dict[str, str], container_id: str, code: int, oom: bool) -> None:
            if uid := labels.get(LABEL_UID):
                on_exit(uid, container_id, code, oom)

        self.watch_dies(heard)
