"""What the suite's emulators of clouds (modal_emulator/, k8s_emulator/) share on the
Docker side: an emulator instance's containers on the local engine and one network, all
labelled with the instance (`label=instance`), so that everything it made is found and
removed by label, also after a crash. Blocking docker SDK calls: the emulators run them
in threads. A container's end is heard from Docker's event stream (`die`, and `oom`: see
`watch_dies`), read in a thread of its own."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import docker
import docker.errors

# Docker reports a kernel OOM kill with two events: `oom`, when containerd's shim reads the
# cgroup's OOM notice, and `die`, when it reaps the process. The shim sends them from two
# goroutines, so on a loaded machine `die` may come first (moby/moby#15621, #18510). Docker
# 20.10 then never says OOMKilled: its `State.OOMKilled` is written once, at the exit, from
# whether containerd's TaskOOM came before the TaskExit (v20.10.24's daemon/monitor.go
# handleContainerExit and libcontainerd/remote/client.go processEventStream; the later
# `oom` only logs the event). The runtime a kubelet uses takes an OOM in either order
# (containerd's CRI sets the container's reason OOMKilled on a TaskOOM event whatever its
# state, pkg/cri/server/events.go). So a container is told OOM-killed when Docker said
# `oom` of it, or its state says so; a `die` with SIGKILL's exit code and neither is
# reported once the `oom` event came, or OOM_LATE_SECONDS after the `die` without one (a
# SIGKILL that was no OOM kill: the emulators' own kills write their outcome themselves
# and do not wait on this).
_SIGKILL_EXIT = 128 + 9
OOM_LATE_SECONDS = 10.0

# on_die(the container's labels, its id, its exit code, whether the kernel OOM-killed it)
OnDie = Callable[[dict[str, str], str, int, bool], None]


class InstanceContainers:
    def __init__(self, label: str, instance: str, network: str | None, timeout: int) -> None:
        self.label = label
        self.instance = instance
        self.network = network
        self._client = docker.from_env(timeout=timeout)
        self._network_made = False
        self._events: Any = None
        self._ooms: set[str] = set()  # containers whose `oom` event came, not yet reported
        self._oom_heard = threading.Condition()
        self._closed = False

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

    def watch_dies(self, on_die: OnDie) -> None:
        """Call `on_die(labels, container id, exit code, OOM-killed)` (from a thread) as
        containers of this instance end; a container the kernel OOM-killed once Docker has
        said so, whichever of its `die` and `oom` events came first."""
        self._events = docker.from_env(timeout=None).events(
            decode=True,
            filters={"type": "container", "event": ["die", "oom"], "label": self.selector},
        )

        def read() -> None:
            try:
                for event in self._events:
                    self.heard(event, on_die)
            except Exception:  # noqa: BLE001 - the stream was closed at shutdown
                return

        threading.Thread(target=read, name="docker-events", daemon=True).start()

    def heard(self, event: dict[str, Any], on_die: OnDie) -> None:
        """One event of Docker's stream: an `oom` is kept for its `die`; a `die` is reported
        now, or, a SIGKILL Docker has not said was an OOM kill yet, from a thread of its
        own once it has or OOM_LATE_SECONDS have passed."""
        actor = event.get("Actor", {})
        attributes = actor.get("Attributes", {})
        container_id = actor.get("ID", "")
        if event.get("Action") == "oom":
            with self._oom_heard:
                self._ooms.add(container_id)
                self._oom_heard.notify_all()
            return
        code = int(attributes.get("exitCode", "-1"))
        with self._oom_heard:
            heard = container_id in self._ooms
        if heard or code != _SIGKILL_EXIT:
            # Whatever else ended it, Docker told an OOM kill it knew of at the exit by its
            # `oom` first (one queue of events per container): only a SIGKILL's may be late.
            self._report(on_die, attributes, container_id, code, heard)
            return
        oom_killed = self._state_says_oom(container_id)
        if oom_killed is not None:
            self._report(on_die, attributes, container_id, code, oom_killed)
            return

        def later() -> None:
            with self._oom_heard:
                heard = self._oom_heard.wait_for(
                    lambda: container_id in self._ooms or self._closed, OOM_LATE_SECONDS
                )
                if self._closed:
                    return
            self._report(on_die, attributes, container_id, code, heard)

        threading.Thread(target=later, name="docker-oom-wait", daemon=True).start()

    def _state_says_oom(self, container_id: str) -> bool | None:
        """Whether the SIGKILLed container's state says the kernel OOM-killed it; None
        while its `oom` may still come: the state says not, and the container is still
        there. A container gone (removed, by an emulator that ended it), or an engine that
        cannot be asked, is taken as no OOM kill, so that its `die` is reported at once: an
        error here must not end the thread that reads the stream."""
        try:
            state = self._client.api.inspect_container(container_id)["State"]
        except (docker.errors.DockerException, OSError):
            return False
        return True if state.get("OOMKilled") else None

    def _report(
        self,
        on_die: OnDie,
        attributes: dict[str, str],
        container_id: str,
        code: int,
        oom_killed: bool,
    ) -> None:
        with self._oom_heard:
            self._ooms.discard(container_id)
        on_die(attributes, container_id, code, oom_killed)

    def close(self) -> None:
        with self._oom_heard:
            self._closed = True  # a `die` still waiting for its `oom` is reported no more
            self._oom_heard.notify_all()
        if self._events is not None:
            self._events.close()
        self.remove_all()
        if self._network_made and self.network is not None:
            # Still in use by someone else's container: left as it is.
            with contextlib.suppress(docker.errors.APIError):
                self._client.networks.get(self.network).remove()
        self._client.close()
