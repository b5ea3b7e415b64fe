"""The test kubelet (and the scheduler) inside the emulator process: each pod becomes a
real Docker container.

One loop: woken by every object change (and every 0.5 s, for readiness probes and
deadlines), it binds pending pods to nodes, starts the containers of bound ones (their
secrets present, their image "pullable"), probes readiness, enforces
`activeDeadlineSeconds` against the emulator's clock, and hears container exits from
Docker's event stream. Graceful deletion stops the container (`docker stop -t G`), then
removes it and the Pod object; the store then deletes what the pod owned.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from . import podstatus
from .runtime import Runtime
from .scheduling import DEFAULT_NODES, TERMINATED, place
from .store import Store, parse_time

log = logging.getLogger("k8s_emulator.kubelet")
_TICK = 0.5
_ERR_IMAGE_PULL_SECONDS = 1.0
_MAX_BACKOFF = 10.0


@dataclass
class PodRuntime:
    uid: str
    container_id: str | None = None
    start: asyncio.Task[None] | None = None
    stop: asyncio.Task[None] | None = None
    pulls: int = 0
    next_pull: float = 0.0
    backoff: float = 0.0
    ready: bool = False


class ConfigError(Exception):
    """The container cannot be made yet (CreateContainerConfigError)."""


class Kubelet:
    def __init__(self, store: Store, runtime: Runtime) -> None:
        self.store = store
        self.runtime = runtime
        self.nodes: list[dict[str, Any]] = [dict(n) for n in DEFAULT_NODES]
        self.paused = False
        self.unpullable: set[str] = set()
        self.pods: dict[str, PodRuntime] = {}
        self._images: set[str] = set()
        self.host_ip = "127.0.0.1"
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
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
        """Return after a whole sync pass that started after this call."""
        self._idle.clear()
        self.wake()
        await asyncio.wait_for(self._idle.wait(), 30)

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _TICK)
            self._wake.clear()
            try:
                await self.sync()
            except Exception:
                log.exception("kubelet sync failed")
            self._idle.set()

    async def sync(self) -> None:
        for pod in self.store.list("pods", None):
            meta, status = pod["metadata"], pod["status"]
            if meta.get("deletionTimestamp") or status.get("phase") in TERMINATED:
                continue
            if not pod["spec"].get("nodeName") and not self._schedule(pod):
                continue
            runtime = self.pods.setdefault(meta["uid"], PodRuntime(meta["uid"]))
            if self._deadline_passed(pod):
                self._fail_deadline(pod, runtime)
            elif runtime.container_id is None:
                if runtime.start is None and not self.paused:
                    await self._try_start(pod, runtime)
            elif not runtime.ready:
                await self._readiness(pod, runtime)

    def _changed(self, pod: dict[str, Any], before: Any) -> None:
        if before != (pod["spec"], pod["status"]):
            self.store.update("pods", pod)

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
        image = pod["spec"]["containers"][0]["image"]
        known = image in self.unpullable or image in self._images
        if not known and await asyncio.to_thread(self.runtime.image_exists, image):
            self._images.add(image)  # present locally: used as it is, never pulled
        if image in self.unpullable or image not in self._images:
            self._pull_failed(pod, runtime, image)
            self._changed(pod, before)
            return
        try:
            env = self._env(pod)
        except ConfigError as exc:
            podstatus.waiting(pod, "CreateContainerConfigError", str(exc))
            self._changed(pod, before)
            return
        runtime.start = asyncio.create_task(self._start(pod, runtime, env))

    def _pull_failed(self, pod: dict[str, Any], runtime: PodRuntime, image: str) -> None:
        """ErrImagePull for a second, then ImagePullBackOff for 2, 4, 8 (at most 10)
        seconds, then another attempt (real kubelets: 10 s doubling up to 5 minutes)."""
        now = asyncio.get_running_loop().time()
        if now < runtime.next_pull:
            if now >= runtime.next_pull - runtime.backoff + _ERR_IMAGE_PULL_SECONDS:
                podstatus.image_pull_failed(pod, image, backoff=True)
            return
        runtime.pulls += 1
        runtime.backoff = min(2.0**runtime.pulls, _MAX_BACKOFF) + _ERR_IMAGE_PULL_SECONDS
        runtime.next_pull = now + runtime.backoff
        podstatus.image_pull_failed(pod, image, backoff=False)

    async def _start(self, pod: dict[str, Any], runtime: PodRuntime, env: dict[str, str]) -> None:
        meta = pod["metadata"]
        try:
            container_id, image_id, address = await asyncio.to_thread(self.runtime.run, pod, env)
        except Exception as exc:  # noqa: BLE001 - the engine's refusal is the pod's status
            log.warning("pod %s/%s: container not made: %s", meta["namespace"], meta["name"], exc)
            current = self.store.get("pods", meta["namespace"], meta["name"])
            if current is not None and current["metadata"]["uid"] == runtime.uid:
                before = self._snapshot(current)
                podstatus.waiting(current, "CreateContainerError", str(exc)[:300])
                self._changed(current, before)
            runtime.start = None
            return
        runtime.container_id = container_id
        current = self.store.get("pods", meta["namespace"], meta["name"])
        if current is None or current["metadata"]["uid"] != runtime.uid:
            await asyncio.to_thread(self.runtime.remove, container_id)  # deleted meanwhile
            return
        if current["metadata"].get("deletionTimestamp"):
            return  # the termination task stops it
        if current["status"].get("phase") in TERMINATED:
            return  # ended by its deadline meanwhile: _kill removes the container
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
        before = self._snapshot(pod)
        podstatus.deadline_exceeded(pod, self.store.timestamp())
        self._changed(pod, before)
        grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        runtime.stop = asyncio.create_task(self._kill(runtime, grace))

    async def _kill(self, runtime: PodRuntime, grace: int) -> None:
        if runtime.start is not None:
            await asyncio.gather(runtime.start, return_exceptions=True)
        if runtime.container_id is not None:
            await asyncio.to_thread(self.runtime.stop, runtime.container_id, grace)
            await asyncio.to_thread(self.runtime.remove, runtime.container_id)

    def _exit_heard(self, uid: str, container_id: str, code: int) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(
                lambda: asyncio.ensure_future(self._exited(uid, container_id, code))
            )

    async def _exited(self, uid: str, container_id: str, code: int) -> None:
        runtime = self.pods.get(uid)
        if runtime is not None and runtime.container_id is None and runtime.start is not None:
            await asyncio.gather(runtime.start, return_exceptions=True)  # exited at once
        if runtime is None or runtime.container_id != container_id:
            return
        pod = next((p for p in self.store.list("pods", None) if p["metadata"]["uid"] == uid), None)
        if pod is None or pod["status"].get("phase") in TERMINATED:
            return
        times = await asyncio.to_thread(self.runtime.exit_code, container_id)
        _, started, finished = times or (code, None, None)
        before = self._snapshot(pod)
        podstatus.terminated(pod, code, container_id, started, finished, self.store.timestamp())
        self._changed(pod, before)

    # --- deletion ----------------------------------------------------------------------

    def delete(self, pod: dict[str, Any], grace: int) -> dict[str, Any]:
        """Delete a pod as the API does with grace period `grace`; the object answered."""
        meta = pod["metadata"]
        runtime = self.pods.get(meta["uid"])
        live = (
            runtime is not None
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
        runtime.stop = asyncio.create_task(self._terminate(pod, runtime, grace))
        return pod

    async def _terminate(self, pod: dict[str, Any], runtime: PodRuntime, grace: int) -> None:
        try:
            await self._kill(runtime, grace)
        finally:
            meta = pod["metadata"]
            current = self.store.get("pods", meta["namespace"], meta["name"])
            if current is not None and current["metadata"]["uid"] == runtime.uid:
                self.store.remove("pods", meta["namespace"], meta["name"])
            self.pods.pop(runtime.uid, None)

    def _forget(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        self.store.remove("pods", meta["namespace"], meta["name"])
        runtime = self.pods.pop(meta["uid"], None)
        if runtime is not None and (runtime.container_id or runtime.start):
            asyncio.create_task(self._kill(runtime, 0))

    async def reset(self) -> None:
        for runtime in list(self.pods.values()):
            for task in (runtime.start, runtime.stop):
                if task is not None:
                    task.cancel()
        self.pods.clear()
        self.paused = False
        self.unpullable = set()
        self.nodes = [dict(n) for n in DEFAULT_NODES]
        self._images.clear()
        await asyncio.to_thread(self.runtime.remove_all)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._probe.aclose()
        await asyncio.to_thread(self.runtime.close)
