"""The test kubelet (and the scheduler, and the PodGC controller) inside the emulator
process: each pod becomes a real Docker container.

One loop: woken by every object change (and every 0.5 s, for readiness probes and
deadlines), it binds pending pods to nodes, starts the containers of bound ones (their
secrets present, their image "pullable"), probes readiness, enforces
`activeDeadlineSeconds` against the emulator's clock, and hears container exits from
Docker's event stream; each pass ends with the cluster autoscaler's scan (autoscaler.py),
whose new nodes the next pass uses. Graceful deletion stops the container
(`docker stop -t G`), writes the pod's terminal phase, then removes the container and
the Pod object; the store then deletes what the pod owned. The control API adds what the
machine does: an OOM kill, a node-pressure eviction, a node that is lost (and the PodGC
controller's collection of its pods).

Whenever the kubelet stops a container itself (delete, deadline, eviction) it marks the
pod's runtime `ending`: the container's death is then its own doing, written once the
container has stopped, and never mistaken for an exit of the container's own.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import logging
from dataclasses import dataclass, replace
from typing import Any

import httpx

from . import admission, eviction, podstatus, pulls
from .autoscaler import Autoscaler
from .runtime import Exit, Runtime
from .scheduling import DEFAULT_NODES, TERMINATED, place
from .store import Store, parse_time

log = logging.getLogger("k8s_emulator.kubelet")
_TICK = 0.5
_ERR_IMAGE_PULL_SECONDS = 1.0
_MAX_BACKOFF = 10.0
# The kubelet's runtime manager gives a container at least 2 s between SIGTERM and
# SIGKILL, whatever grace it was asked for (kubernetes/kubernetes
# pkg/kubelet/kuberuntime/kuberuntime_container.go killContainer,
# minimumGracePeriodInSeconds; "always give containers a minimal shutdown window").
MINIMUM_GRACE_SECONDS = 2
# A hard eviction asks for 1 s (pkg/kubelet/eviction/eviction_manager.go,
# immediateEvictionGracePeriodSeconds), raised to the 2 s above.
EVICTION_GRACE_SECONDS = 1


@dataclass
class PodRuntime:
    uid: str
    namespace: str = ""
    name: str = ""
    container_id: str | None = None
    start: asyncio.Task[None] | None = None
    stop: asyncio.Task[None] | None = None
    pulls: int = 0
    next_pull: float = 0.0
    backoff: float = 0.0
    ready: bool = False
    # Why the kubelet itself is ending the container ("deleted", "deadline", "evicted",
    # "oom"): its death is written by that path, not as an exit of its own.
    ending: str | None = None
    lost: bool = False  # its node is gone: nothing reports for it any more


class NotRunning(Exception):
    """The pod is not where the control call can act on it (404 / 409)."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code


class ConfigError(Exception):
    """The container cannot be made yet (CreateContainerConfigError)."""


class Kubelet:
    def __init__(self, store: Store, runtime: Runtime) -> None:
        self.store = store
        self.runtime = runtime
        self.nodes: list[dict[str, Any]] = [dict(n) for n in DEFAULT_NODES]
        self.paused = False
        self.unpullable: set[str] = set()
        # Per image, how many pulls (per pod) fail before one succeeds (pulls.py).
        self.flaky_pulls: dict[str, int] = {}
        self.pods: dict[str, PodRuntime] = {}
        self.autoscaler = Autoscaler(store)
        self._images: set[str] = set()
        self._image_users: dict[str, str] = {}
        self.host_ip = "127.0.0.1"
        # uid -> (namespace/name, the task that stops it) of pods ended by their deadline
        self.deadline_kills: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one sync pass, or a reset, or a lost node, at a time
        self._passes_started = 0
        self._passes_done = 0
        self._done = asyncio.Condition()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._probe = httpx.AsyncClient(timeout=1.0)
        store.on_change = self.wake

    # --- the loop ----------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await asyncio.to_thread(self.runtime.ensure_network)
        self.host_ip = await asyncio.to_thread(self.runtime.host_ip)
        self.runtime.watch_exits(self._exit_heard)
        self._task = asyncio.create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    async def settle(self) -> None:
        """Return after a whole sync pass that started after this call (one that was
        under way when it came does not count: it may have missed the change)."""
        wanted = self._passes_started + 1
        self.wake()
        async with self._done:
            await asyncio.wait_for(self._done.wait_for(lambda: self._passes_done >= wanted), 120)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _TICK)
            self._wake.clear()
            self._passes_started += 1
            number = self._passes_started
            try:
                await self.sync()
            except Exception:
                log.exception("kubelet sync failed")
            self._passes_done = number
            async with self._done:
                self._done.notify_all()

    def _spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        """A background task the kubelet keeps track of (reset waits for or cancels it)."""
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def sync(self) -> None:
        async with self._lock:
            for pod in self.store.list("pods", None):
                meta, status = pod["metadata"], pod["status"]
                if self.store.get("pods", meta["namespace"], meta["name"]) is not pod:
                    continue  # deleted or replaced while this pass awaited: the next one
                if meta.get("deletionTimestamp") or status.get("phase") in TERMINATED:
                    continue
                if not pod["spec"].get("nodeName") and not self._schedule(pod):
                    continue
                runtime = self._runtime(pod)
                if runtime.ending is not None or runtime.lost:
                    continue  # being stopped: that path writes what follows
                if self._deadline_passed(pod):
                    self._fail_deadline(pod, runtime)
                elif runtime.container_id is None:
                    if runtime.start is None and not self.paused:
                        await self._try_start(pod, runtime)
                elif not runtime.ready:
                    await self._readiness(pod, runtime)
            if arrived := self.autoscaler.scan(self.nodes):
                self.nodes = [*self.nodes, *arrived]
                self.wake()  # the next pass places the pods that waited for them

    def _runtime(self, pod: dict[str, Any]) -> PodRuntime:
        meta = pod["metadata"]
        return self.pods.setdefault(
            meta["uid"], PodRuntime(meta["uid"], meta["namespace"], meta["name"])
        )

    def _current(self, runtime: PodRuntime) -> dict[str, Any] | None:
        """The runtime's Pod object as the store holds it now (None: gone, or another pod
        of that name)."""
        pod = self.store.get("pods", runtime.namespace, runtime.name)
        return pod if pod is not None and pod["metadata"]["uid"] == runtime.uid else None

    def _changed(self, pod: dict[str, Any], before: Any) -> None:
        """Write the pod's status (and nodeName) if they changed. The store may hold a
        newer object by now (a label patch while a probe was awaited): the status goes
        onto that one; a pod deleted meanwhile is not brought back."""
        if before == (pod["spec"], pod["status"]):
            return
        meta = pod["metadata"]
        current = self.store.get("pods", meta["namespace"], meta["name"])
        if current is None or current["metadata"]["uid"] != meta["uid"]:
            return
        if current is not pod:
            current["status"] = pod["status"]
            if pod["spec"].get("nodeName"):
                current["spec"]["nodeName"] = pod["spec"]["nodeName"]
        self.store.update("pods", current)

    @staticmethod
    def _snapshot(pod: dict[str, Any]) -> Any:
        return copy.deepcopy((pod["spec"], pod["status"]))

    # --- scheduling --------------------------------------------------------------------

    def _schedule(self, pod: dict[str, Any]) -> bool:
        before = self._snapshot(pod)
        node, message = place(pod, self.nodes, self.store.list("pods", None))
        if node is None:
            podstatus.set_condition(
                pod, "PodScheduled", "False", "Unschedulable", message, self.store.timestamp()
            )
            self._changed(pod, before)
            return False
        pod["spec"]["nodeName"] = node
        podstatus.bound(pod, self.host_ip, self.store.timestamp())
        self._changed(pod, before)
        return True

    # --- starting ----------------------------------------------------------------------

    def _env(self, pod: dict[str, Any]) -> dict[str, str]:
        namespace = pod["metadata"]["namespace"]
        container = pod["spec"]["containers"][0]
        env: dict[str, str] = {}

        def secret_data(name: str, optional: bool) -> dict[str, str] | None:
            secret = self.store.get("secrets", namespace, name)
            if secret is None:
                if optional:
                    return None
                raise ConfigError(f'secret "{name}" not found')
            return {
                k: base64.b64decode(v).decode("utf-8", "replace")
                for k, v in (secret.get("data") or {}).items()
            }

        for source in container.get("envFrom") or []:
            prefix = source.get("prefix") or ""
            if source.get("configMapRef"):
                ref = source["configMapRef"]
                if not ref.get("optional"):
                    raise ConfigError(f'configmap "{ref.get("name")}" not found')
                continue
            ref = source.get("secretRef") or {}
            data = secret_data(str(ref.get("name")), bool(ref.get("optional")))
            for key, value in (data or {}).items():
                env[prefix + key] = value
        for variable in container.get("env") or []:
            name, source = variable["name"], variable.get("valueFrom")
            if source is None:
                env[name] = str(variable.get("value") or "")
            elif source.get("secretKeyRef"):
                ref = source["secretKeyRef"]
                data = secret_data(str(ref.get("name")), bool(ref.get("optional")))
                if data is not None and ref["key"] in data:
                    env[name] = data[ref["key"]]
                elif data is not None and not ref.get("optional"):
                    raise ConfigError(
                        f"couldn't find key {ref['key']} in Secret {namespace}/{ref['name']}"
                    )
            elif source.get("fieldRef"):
                path = source["fieldRef"].get("fieldPath", "")
                env[name] = {
                    "metadata.name": pod["metadata"]["name"],
                    "metadata.namespace": namespace,
                    "metadata.uid": pod["metadata"]["uid"],
                    "spec.nodeName": pod["spec"].get("nodeName", ""),
                    "status.hostIP": self.host_ip,
                }.get(path, "")
        return env

    async def _try_start(self, pod: dict[str, Any], runtime: PodRuntime) -> None:
        before = self._snapshot(pod)
        container = pod["spec"]["containers"][0]
        image = container["image"]
        if (invalid := pulls.invalid_name(image)) is not None:
            podstatus.waiting(pod, "InvalidImageName", invalid)
            self._changed(pod, before)
            return
        known = image in self.unpullable or image in self._images
        if not known and await asyncio.to_thread(self.runtime.image_exists, image):
            self._images.add(image)  # present locally: used as it is, never pulled
        if pulls.never_pull(container) and image not in self._images:
            podstatus.waiting(pod, "ErrImageNeverPull", pulls.never_pull_message(image))
            self._changed(pod, before)
            return
        # Failing still, or backing off after its last failure.
        flaky = runtime.pulls < self.flaky_pulls.get(image, 0) or (
            image in self.flaky_pulls and self.store.now() < runtime.next_pull
        )
        if image in self.unpullable or image not in self._images or flaky:
            self._pull_failed(pod, runtime, image, transient=flaky)
            self._changed(pod, before)
            return
        try:
            env = self._env(pod)
            await self._check_user(pod, image)
        except ConfigError as exc:
            podstatus.waiting(pod, "CreateContainerConfigError", str(exc))
            self._changed(pod, before)
            return
        runtime.start = self._spawn(self._start(pod, runtime, env))

    async def _check_user(self, pod: dict[str, Any], image: str) -> None:
        """ConfigError when runAsNonRoot forbids the user the container would run as."""
        if image not in self._image_users:
            self._image_users[image] = await asyncio.to_thread(self.runtime.image_user, image)
        refusal = admission.run_as_non_root(pod, self._image_users[image])
        if refusal is not None:
            raise ConfigError(refusal)

    def _pull_failed(
        self, pod: dict[str, Any], runtime: PodRuntime, image: str, *, transient: bool = False
    ) -> None:
        """ErrImagePull for a second, then ImagePullBackOff for 2, 4, 8 (at most 10)
        seconds, then another attempt (real kubelets: 10 s doubling up to 5 minutes), on
        the emulator's clock (`advance_clock` ends a backoff). `transient`: a pull that
        will succeed (`set_flaky_pulls`), refused meanwhile by the registry's rate limit."""
        now = self.store.now()
        if now < runtime.next_pull:
            if now >= runtime.next_pull - runtime.backoff + _ERR_IMAGE_PULL_SECONDS:
                podstatus.image_pull_failed(pod, image, backoff=True)
            return
        runtime.pulls += 1
        runtime.backoff = min(2.0**runtime.pulls, _MAX_BACKOFF) + _ERR_IMAGE_PULL_SECONDS
        runtime.next_pull = now + runtime.backoff
        if transient:
            podstatus.waiting(pod, "ErrImagePull", pulls.rate_limited_message(image))
        else:
            podstatus.image_pull_failed(pod, image, backoff=False)

    async def _start(self, pod: dict[str, Any], runtime: PodRuntime, env: dict[str, str]) -> None:
        meta = pod["metadata"]
        try:
            container_id, image_id, address = await asyncio.to_thread(self.runtime.run, pod, env)
        except Exception as exc:  # noqa: BLE001 - the engine's refusal is the pod's status
            log.warning("pod %s/%s: container not made: %s", meta["namespace"], meta["name"], exc)
            current = self._current(runtime)
            if current is not None:
                before = self._snapshot(current)
                podstatus.waiting(current, "CreateContainerError", str(exc)[:300])
                self._changed(current, before)
            runtime.start = None
            return
        runtime.container_id = container_id
        current = self._current(runtime)
        if current is None or runtime.lost:
            await asyncio.to_thread(self.runtime.remove, container_id)  # deleted meanwhile
            return
        if current["metadata"].get("deletionTimestamp") or runtime.ending is not None:
            return  # the task that ends it stops the container
        if current["status"].get("phase") in TERMINATED:
            return
        before = self._snapshot(current)
        has_probe = bool(
            (current["spec"]["containers"][0].get("readinessProbe") or {}).get("httpGet")
        )
        runtime.ready = not has_probe
        podstatus.running(
            current, container_id, image_id, address, self.store.timestamp(), ready=runtime.ready
        )
        self._changed(current, before)

    async def _readiness(self, pod: dict[str, Any], runtime: PodRuntime) -> None:
        container = pod["spec"]["containers"][0]
        probe = container["readinessProbe"]["httpGet"]
        port = probe.get("port")
        if isinstance(port, str) and not port.isdigit():
            named = [p for p in container.get("ports") or [] if p.get("name") == port]
            port = named[0]["containerPort"] if named else None
        scheme = str(probe.get("scheme") or "HTTP").lower()
        url = f"{scheme}://{pod['status']['podIP']}:{port}{probe.get('path') or '/'}"
        try:
            response = await self._probe.get(url)
        except httpx.HTTPError:
            return
        if runtime.ending is not None or runtime.lost:
            return
        if 200 <= response.status_code < 400:
            runtime.ready = True
            before = self._snapshot(pod)
            podstatus.ready(pod, self.store.timestamp())
            self._changed(pod, before)

    # --- endings -----------------------------------------------------------------------

    def _deadline_passed(self, pod: dict[str, Any]) -> bool:
        deadline = pod["spec"].get("activeDeadlineSeconds")
        started = pod["status"].get("startTime")
        return bool(deadline and started and self.store.now() - parse_time(started) >= deadline)

    def _fail_deadline(self, pod: dict[str, Any], runtime: PodRuntime) -> None:
        """Past `activeDeadlineSeconds`: Ready turns False at once, the container is
        stopped with the pod's grace period, then the pod is written Failed,
        DeadlineExceeded (https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/pod-v1/#lifecycle)."""
        runtime.ending = "deadline"
        before = self._snapshot(pod)
        podstatus.deadline_passed(pod, self.store.timestamp())
        self._changed(pod, before)
        grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        runtime.stop = self._spawn(self._end_deadline(runtime, grace))
        key = f"{runtime.namespace}/{runtime.name}"
        self.deadline_kills[runtime.uid] = (key, runtime.stop)

    async def _end_deadline(self, runtime: PodRuntime, grace: int) -> None:
        end = await self._stop(runtime, grace)
        pod = self._current(runtime)
        if pod is not None and not runtime.lost:
            before = self._snapshot(pod)
            podstatus.deadline_exceeded(pod, end, runtime.container_id, self.store.timestamp())
            self._changed(pod, before)
        if runtime.container_id is not None:
            # The emulator removes the container now (a kubelet keeps it until the pod goes).
            await asyncio.to_thread(self.runtime.remove, runtime.container_id)
        self._gone_if_deleted(runtime)

    async def _stop(self, runtime: PodRuntime, grace: int) -> Exit | None:
        """Stop the pod's container as the kubelet does (SIGTERM, SIGKILL after the grace
        period, at least 2 s) and tell how it ended; None if it never ran."""
        if runtime.start is not None:
            await asyncio.gather(runtime.start, return_exceptions=True)
        if runtime.container_id is None:
            return None
        grace = max(grace, MINIMUM_GRACE_SECONDS)
        await asyncio.to_thread(self.runtime.stop, runtime.container_id, grace)
        return await asyncio.to_thread(self.runtime.exit_info, runtime.container_id)

    def _gone_if_deleted(self, runtime: PodRuntime) -> None:
        """A pod deleted (gracefully) while the kubelet was already stopping it goes once
        that is done, its container with it."""
        pod = self._current(runtime)
        if pod is None or runtime.lost or not pod["metadata"].get("deletionTimestamp"):
            return
        self.store.remove("pods", runtime.namespace, runtime.name)
        self.pods.pop(runtime.uid, None)
        if runtime.container_id is not None:
            self._spawn(asyncio.to_thread(self.runtime.remove, runtime.container_id))

    def _exit_heard(self, uid: str, container_id: str, code: int, oom_killed: bool) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(
                lambda: self._spawn(self._exited(uid, container_id, code, oom_killed))
            )

    async def _exited(self, uid: str, container_id: str, code: int, oom_killed: bool) -> None:
        """A container ended by itself (or the kernel's OOM killer ended it: Docker said
        so, by its `oom` event or its state, tests/emulator_docker.py)."""
        runtime = self.pods.get(uid)
        if runtime is not None and runtime.container_id is None and runtime.start is not None:
            await asyncio.gather(runtime.start, return_exceptions=True)  # exited at once
        if runtime is None or runtime.container_id != container_id or runtime.ending:
            return
        end = await asyncio.to_thread(self.runtime.exit_info, container_id)
        if runtime.ending is not None or runtime.lost:
            return  # the kubelet began to stop it meanwhile: that path writes the end
        pod = self._current(runtime)
        if pod is None or pod["status"].get("phase") in TERMINATED:
            return
        before = self._snapshot(pod)
        end = end or Exit(code, None, None, oom_killed=False)
        if oom_killed and not end.oom_killed:
            end = replace(end, oom_killed=True)  # its `oom` came after the exit: CRI's reason
        podstatus.exited(pod, end, container_id, self.store.timestamp())
        self._changed(pod, before)

    # --- what the machine does (control API) -------------------------------------------

    def _running(self, namespace: str, name: str) -> tuple[dict[str, Any], PodRuntime]:
        pod = self.store.get("pods", namespace, name)
        if pod is None:
            raise NotRunning(404, f'pods "{name}" not found')
        runtime = self.pods.get(pod["metadata"]["uid"])
        if (
            not pod["spec"].get("nodeName")
            or runtime is None
            or runtime.lost
            or pod["status"].get("phase") in TERMINATED
            or pod["metadata"].get("deletionTimestamp")
            or runtime.ending is not None
        ):
            raise NotRunning(409, f"pod {namespace}/{name} is not running on a node")
        return pod, runtime

    async def oom_kill(self, namespace: str, name: str) -> dict[str, Any]:
        """The kernel's OOM killer ends the pod's container (SIGKILL, as at its memory
        limit); answered once the pod shows it: `terminated.reason: OOMKilled`, exit code
        137, and (never restarted) phase Failed
        (https://kubernetes.io/docs/tasks/configure-pod-container/assign-memory-resource/#exceed-a-container-s-memory-limit)."""
        async with self._lock:
            pod, runtime = self._running(namespace, name)
            if runtime.start is not None:
                await asyncio.gather(runtime.start, return_exceptions=True)
            if runtime.container_id is None or runtime.ending is not None:
                raise NotRunning(409, f"pod {namespace}/{name} has no running container")
            runtime.ending = "oom"
        container_id = runtime.container_id
        await asyncio.to_thread(self.runtime.kill, container_id)
        end = await asyncio.to_thread(self.runtime.exit_info, container_id)
        # Docker does not mark a container it was told to kill as OOM-killed: the emulator
        # does, as the runtime reports a container the OOM killer ended.
        end = (
            Exit(137, None, None, True)
            if end is None
            else Exit(end.code, end.started, end.finished, oom_killed=True)
        )
        current = self._current(runtime)
        if current is not None and current["status"].get("phase") not in TERMINATED:
            before = self._snapshot(current)
            podstatus.exited(current, end, container_id, self.store.timestamp())
            self._changed(current, before)
        self._gone_if_deleted(runtime)
        return self._current(runtime) or pod

    async def evict(self, namespace: str, name: str, resource: str) -> dict[str, Any]:
        """The kubelet evicts the pod for node pressure on `resource` (a hard threshold):
        its container is stopped (grace 1 s, raised to the runtime's 2 s minimum), then
        the pod is written Failed, Evicted, with the kubelet's message and condition
        DisruptionTarget (TerminationByKubelet); answered once it is
        (https://kubernetes.io/docs/concepts/scheduling-eviction/node-pressure-eviction/,
        https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions)."""
        if resource not in eviction.RESOURCES:
            raise NotRunning(400, f"resource: one of {', '.join(eviction.RESOURCES)}")
        async with self._lock:
            pod, runtime = self._running(namespace, name)
            usage = None
            if runtime.container_id is not None:
                usage = await asyncio.to_thread(
                    self.runtime.memory_working_set, runtime.container_id
                )
            message = eviction.message(resource, pod, usage)
            runtime.ending = "evicted"
            runtime.stop = self._spawn(self._end_evicted(runtime, message))
        await asyncio.gather(runtime.stop, return_exceptions=True)
        return self._current(runtime) or pod

    async def _end_evicted(self, runtime: PodRuntime, message: str) -> None:
        end = await self._stop(runtime, EVICTION_GRACE_SECONDS)
        pod = self._current(runtime)
        if pod is not None and not runtime.lost:
            before = self._snapshot(pod)
            podstatus.evicted(pod, end, runtime.container_id, message, self.store.timestamp())
            self._changed(pod, before)
        self._gone_if_deleted(runtime)

    async def lose_node(self, node_name: str) -> list[str]:
        """The node is gone (its machine, and then its Node object): its containers go
        with it, nothing reports for its pods any more, and the PodGC controller marks
        each of them Failed with condition DisruptionTarget (DeletionByPodGC) and deletes
        it (grace 0) (https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-garbage-collection,
        https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions).
        The pods collected, as namespace/name."""
        async with self._lock:
            if not any(n["name"] == node_name for n in self.nodes):
                raise NotRunning(404, f'nodes "{node_name}" not found')
            self.nodes = [n for n in self.nodes if n["name"] != node_name]
            pods = self.store.list("pods", None)
            bound = [p for p in pods if p["spec"].get("nodeName") == node_name]
            for pod in bound:
                runtime = self.pods.pop(pod["metadata"]["uid"], None)
                if runtime is None:
                    continue
                runtime.lost = True
                if runtime.start is not None:
                    await asyncio.gather(runtime.start, return_exceptions=True)
                if runtime.stop is not None:
                    runtime.stop.cancel()
                if runtime.container_id is not None:
                    await asyncio.to_thread(self.runtime.remove, runtime.container_id)
            collected = []
            for pod in bound:
                meta = pod["metadata"]
                current = self.store.get("pods", meta["namespace"], meta["name"])
                if current is None or current["metadata"]["uid"] != meta["uid"]:
                    continue
                if current["status"].get("phase") not in TERMINATED:
                    podstatus.collected(current, self.store.timestamp())
                    self.store.update("pods", current)
                self.store.remove("pods", meta["namespace"], meta["name"])
                collected.append(f"{meta['namespace']}/{meta['name']}")
            return collected

    # --- deletion ----------------------------------------------------------------------

    def delete(self, pod: dict[str, Any], grace: int) -> dict[str, Any]:
        """Delete a pod as the API does with grace period `grace`; the object answered."""
        meta = pod["metadata"]
        runtime = self.pods.get(meta["uid"])
        live = (
            runtime is not None
            and not runtime.lost
            and (runtime.container_id or runtime.start)
            and (pod["status"].get("phase") not in TERMINATED)
        )
        if grace == 0 or not live:
            self._forget(pod)
            return pod
        if meta.get("deletionTimestamp"):
            return pod  # already terminating: its first grace period holds
        meta["deletionTimestamp"] = podstatus.rfc3339_in(self.store, grace)
        meta["deletionGracePeriodSeconds"] = grace
        self.store.update("pods", pod)
        assert runtime is not None
        if runtime.ending is None:
            runtime.ending = "deleted"
            runtime.stop = self._spawn(self._terminate(runtime, grace))
        # else: already being stopped (deadline, eviction): the pod goes once that is done
        return pod

    async def _terminate(self, runtime: PodRuntime, grace: int) -> None:
        try:
            end = await self._stop(runtime, grace)
            pod = self._current(runtime)
            if pod is not None and not runtime.lost and end is not None:
                before = self._snapshot(pod)
                podstatus.stopped(pod, end, runtime.container_id, self.store.timestamp())
                self._changed(pod, before)  # the terminal phase, then the pod goes
            if runtime.container_id is not None:
                await asyncio.to_thread(self.runtime.remove, runtime.container_id)
        finally:
            if not runtime.lost:
                if self._current(runtime) is not None:
                    self.store.remove("pods", runtime.namespace, runtime.name)
                self.pods.pop(runtime.uid, None)

    async def _kill(self, runtime: PodRuntime) -> None:
        if runtime.start is not None:
            await asyncio.gather(runtime.start, return_exceptions=True)
        if runtime.container_id is not None:
            await asyncio.to_thread(self.runtime.remove, runtime.container_id)

    def _forget(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.store.remove("pods", meta["namespace"], meta["name"])
        runtime = self.pods.pop(meta["uid"], None)
        if runtime is not None and (runtime.container_id or runtime.start):
            self._spawn(self._kill(runtime))

    async def reset(self) -> None:
        """Back to the start: every container removed (also one being made now), then the
        store's objects; no sync pass runs meanwhile."""
        async with self._lock:
            starts = [r.start for r in self.pods.values() if r.start is not None]
            await asyncio.gather(*starts, return_exceptions=True)
            for task in list(self._tasks):
                if not task.done():
                    task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self.pods.clear()
            self.deadline_kills.clear()
            self.paused = False
            self.unpullable = set()
            self.flaky_pulls = {}
            self.autoscaler.reset()
            self.nodes = [dict(n) for n in DEFAULT_NODES]
            self._images.clear()
            await asyncio.to_thread(self.runtime.remove_all)
            self.store.reset()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._probe.aclose()
        await asyncio.to_thread(self.runtime.close)
