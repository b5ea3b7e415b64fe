"""One Docker engine of local-docker: its workers as containers, through the `docker` SDK.

The SDK blocks, so every call runs in a worker thread (`asyncio.to_thread` keeps the
context, and with it the trace span). Docker and requests errors are translated into
ProviderError here and nowhere else."""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

import docker
import requests
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import DeviceRequest

from openalice_scheduler.config import Settings
from openalice_scheduler.errors import ProviderError, ProviderUnavailable
from openalice_scheduler.models import LostCause
from openalice_scheduler.providers.base import (
    Worker,
    WorkerDeath,
    WorkerInfo,
    WorkerSpec,
    worker_env,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

LABEL_LEASE = "openalice.scheduler.lease_id"
LABEL_KIND = "openalice.scheduler.kind"
LABEL_OWNER = "openalice.scheduler.owner"
LABEL_INSTANCE = "openalice.scheduler.instance"
LABEL_STORE = "openalice.scheduler.store"
# Docker API 1.41 (engine 20.10) has everything used here; naming it avoids a version
# round trip at start-up, so the service starts even while the engine is down.
DOCKER_API_VERSION = "1.41"
# The exit code of a process killed by SIGKILL (128 + 9): the OOM killer's, among others.
SIGKILLED = 137
# How long the death of a SIGKILLed container that may have been an OOM kill waits for
# the engine's word on it (events.py: its `oom` event; a listing: its state), the two
# coming milliseconds apart when both come.
OOM_GRACE_S = 2.0
_PING_TTL = 0.5
# A fleet's pings have a client of their own with a short timeout: an engine whose host
# stopped answering (packets dropped) must not hold a thread for the 60 s a container
# create may need.
_PING_TIMEOUT_S = 3


def container_name(kind: str, lease_id: str) -> str:
    return f"oa-{kind}-{uuid.UUID(lease_id).hex[:12]}"


class DockerEngine:
    """One Docker engine: its client, its network, its workers. `error()` says whether
    it answers, from a ping cached for a moment (100 concurrent acquires cost one
    ping); any call that finds it unreachable makes the next `error()` look again."""

    def __init__(
        self,
        settings: Settings,
        where: str,
        client: docker.DockerClient | None = None,
        tls: docker.tls.TLSConfig | None = None,
    ) -> None:
        self.where = where
        self.instance = settings.scheduler_instance
        self.network = settings.docker_network
        self.images = settings.worker_images
        self.ports = settings.worker_ports
        ssh = where.startswith("ssh://")
        self.client = client or docker.DockerClient(
            base_url=where,
            version=DOCKER_API_VERSION,
            timeout=60,
            max_pool_size=64,
            tls=tls or False,
            use_ssh_client=ssh,
        )
        self._pinger = docker.APIClient(
            base_url=where,
            version=DOCKER_API_VERSION,
            timeout=_PING_TIMEOUT_S,
            tls=tls or False,
            use_ssh_client=ssh,
        )
        if tls is not None:
            # The engine's certificates are checked against its own CA (tls=), never a
            # bundle from the environment: requests lets REQUESTS_CA_BUNDLE (or
            # CURL_CA_BUNDLE) replace a session's CA (psf/requests#3829), and every
            # connection to the engine then failed verification.
            for session in (self.client.api, self._pinger):
                session.trust_env = False
        self._network_ready = False
        self._network_lock = threading.Lock()
        self._ping_at = 0.0
        self._ping_error: str | None = None
        self._probe: asyncio.Task[str | None] | None = None

    async def provision(self, spec: WorkerSpec, device: str | None) -> Worker:
        return await self.run(self._provision, spec, device)

    async def release(self, container_id: str, lease_id: str) -> None:
        await self.run(self._release, container_id, lease_id)

    async def list_workers(self) -> Mapping[str, list[WorkerInfo]]:
        return await self.run(self._list_workers)

    async def error(self, fresh: bool = False) -> str | None:
        """Why the engine cannot be used now, or None: pinged when the last answer is
        older than a moment."""
        if fresh or time.monotonic() - self._ping_at > _PING_TTL:
            await self._ping(self.client.ping)
        return self._ping_error

    async def look(self) -> str | None:
        """A fresh look for a fleet (`GET /v1/providers`), `_PING_TIMEOUT_S` at most."""
        return await self._ping(self._pinger.ping)

    async def health(self, wait: float) -> str | None:
        """`error()` for a fleet, where an engine that does not answer must not slow the
        others. A known-unreachable engine is skipped at once (looked at again in the
        background); an engine that answered is looked at again when its answer is old,
        waiting `wait` at most for it (then the old answer stands). The very first look
        waits for the ping's own timeout: an engine reached through ssh takes a while to
        answer first (an ssh session, `docker system dial-stdio` on the host), and the
        first acquire after a start must not be refused for it ("has not answered yet"
        only when it really did not answer)."""
        if self._ping_at and time.monotonic() - self._ping_at <= _PING_TTL:
            return self._ping_error
        if self._probe is None or self._probe.done():
            self._probe = asyncio.create_task(self._ping(self._pinger.ping))
        if self._ping_error is not None:
            return self._ping_error
        if not self._ping_at:
            wait = max(wait, _PING_TIMEOUT_S)
        try:
            return await asyncio.wait_for(asyncio.shield(self._probe), wait)
        except TimeoutError:
            if not self._ping_at:
                return f"Docker engine at {self.where} has not answered yet"
            return self._ping_error

    def last_error(self) -> str | None:
        """The last look's answer, without looking (None before the first)."""
        return self._ping_error

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        await asyncio.to_thread(self.client.close)
        await asyncio.to_thread(self._pinger.close)

    async def _ping(self, ping: Callable[[], Any]) -> str | None:
        try:
            await self.run(ping)
            self._ping_error = None
        except ProviderError as exc:
            self._ping_error = exc.message
        self._ping_at = time.monotonic()
        return self._ping_error

    # --- blocking parts, run in threads ----------------------------------------------

    def _provision(self, spec: WorkerSpec, device: str | None, retried: bool = False) -> Worker:
        self._ensure_network()
        name = container_name(spec.kind, spec.lease_id)
        image = self.images[spec.kind]
        labels = {
            LABEL_LEASE: spec.lease_id,
            LABEL_KIND: spec.kind.value,
            LABEL_INSTANCE: self.instance,
        }
        if spec.owner_id:
            labels[LABEL_OWNER] = spec.owner_id
        if spec.store_id:
            labels[LABEL_STORE] = spec.store_id
        environment = worker_env(spec)
        device_requests = None
        if device is not None:
            device_requests = [DeviceRequest(device_ids=[device], capabilities=[["gpu"]])]
        try:
            container = self.client.containers.create(
                image,
                name=name,
                hostname=name,
                labels=labels,
                environment=environment,
                network=self.network,
                device_requests=device_requests,
                detach=True,
            )
        except ImageNotFound as exc:
            raise ProviderError(
                f"image {image!r} is not on the Docker engine at {self.where}; "
                "build or pull it first",
                transient=False,
            ) from exc
        except APIError as exc:
            # The network was removed behind our back (404, or 500 "network … not found"
            # when another replica removed a duplicate): make it again, once.
            if not retried and (isinstance(exc, NotFound) or _network_trouble(_explain(exc))):
                self._network_ready = False
                return self._provision(spec, device, retried=True)
            raise ProviderError(f"Docker could not create {name}: {_explain(exc)}") from exc
        try:
            container.start()
        except DockerException as exc:
            _remove_quietly(container)
            if not retried and _network_trouble(_explain(exc)):
                # Replicas sharing DOCKER_NETWORK created it twice at the same moment: the
                # name matched both ("is ambiguous"), or this container was put on the
                # copy another replica then removed ("network … not found"). Keep one
                # (see _ensure_network) and try once more.
                self._network_ready = False
                return self._provision(spec, device, retried=True)
            raise ProviderError(f"Docker could not start {name}: {_explain(exc)}") from exc
        port = self.ports[spec.kind]
        return Worker(
            endpoint=f"http://{name}:{port}",
            provider_token=container.id,
            probe_url=self._address(container, port),
        )

    def _address(self, container: Any, port: int) -> str | None:
        """`http://IP:port` of the container on DOCKER_NETWORK, for its readiness probe:
        reachable from the engine's host, and from a container on that network, where the
        name of the endpoint may not resolve. None when the engine did not say."""
        try:
            container.reload()
        except DockerException as exc:
            log.warning("could not inspect %s for its address: %s", container.name, _explain(exc))
            return None
        networks = container.attrs.get("NetworkSettings", {}).get("Networks") or {}
        address = (networks.get(self.network) or {}).get("IPAddress")
        return f"http://{address}:{port}" if address else None

    def _release(self, container_id: str, lease_id: str) -> None:
        targets = (
            [container_id]
            if container_id
            else [
                c.id
                for c in self.client.containers.list(
                    all=True,
                    sparse=True,
                    filters={
                        "label": [f"{LABEL_LEASE}={lease_id}", f"{LABEL_INSTANCE}={self.instance}"]
                    },
                )
            ]
        )
        for target in targets:
            try:
                self.client.api.remove_container(target, force=True)
            except NotFound:
                continue  # already gone: that is what we wanted
            except APIError as exc:
                if exc.status_code == 409 and "already in progress" in _explain(exc):
                    continue
                raise

    def _list_workers(self) -> Mapping[str, list[WorkerInfo]]:
        found: dict[str, list[WorkerInfo]] = defaultdict(list)
        for row in self.client.api.containers(
            all=True, filters={"label": f"{LABEL_INSTANCE}={self.instance}"}
        ):
            labels = row.get("Labels") or {}
            lease_id = labels.get(LABEL_LEASE)
            if lease_id:
                # Stopped for good: exited or dead. `created` is a container still being
                # started; `paused` and `restarting` are alive. `removing`: Docker is
                # removing it (a release, or `docker rm -f` by hand), which takes a while
                # on a busy engine: an end already under way, not to be ended again.
                state = row.get("State")
                ended = state in ("exited", "dead")
                found[lease_id].append(
                    WorkerInfo(
                        lease_id,
                        row["Id"],
                        store_id=labels.get(LABEL_STORE),
                        death=self._listed_death(row["Id"]) if ended else None,
                        ending=state == "removing",
                    )
                )
        return found

    def end_of(self, container_id: str, exit_code: int | None = None) -> tuple[WorkerDeath, bool]:
        """How a stopped container ended, from its inspection (OOMKilled, ExitCode); one
        already removed meanwhile: `exit_code` as its die event said, cause exited. And
        whether the engine may yet say the kernel's OOM killer ended it (`_end_in`)."""
        return _end_in(self._inspection(container_id), exit_code)

    def _listed_death(self, container_id: str) -> WorkerDeath | None:
        """A listed, stopped container's death; None while a SIGKILL that may yet be told
        an OOM kill is younger than OOM_GRACE_S by its FinishedAt (Docker 20.10 writes
        OOMKilled only if its `oom` came before its `die`, events.py): the next pass
        tells it. An engine's clock ahead of or far behind ours only tells it at once."""
        found = self._inspection(container_id)
        death, may_be_oom = _end_in(found, None)
        if not may_be_oom:
            return death
        finished = str((found.get("State") or {}).get("FinishedAt", ""))
        try:
            age = (datetime.now(UTC) - datetime.fromisoformat(finished)).total_seconds()
        except ValueError:
            return death
        return None if 0 <= age < OOM_GRACE_S else death

    def _inspection(self, container_id: str) -> dict[str, Any]:
        try:
            return dict(self.client.api.inspect_container(container_id))
        except NotFound:
            return {}

    def _ensure_network(self) -> None:
        if self._network_ready:
            return
        with self._network_lock:
            if self._network_ready:
                return
            existing = self._networks_named()
            if not existing:
                log.info("creating Docker network %s", self.network)
                try:
                    self.client.networks.create(
                        self.network,
                        driver="bridge",
                        labels={LABEL_INSTANCE: self.instance},
                        check_duplicate=True,
                    )
                except APIError as exc:
                    # 409: another replica made it meanwhile. 404: ours was a duplicate
                    # that another replica removed before the SDK could look at it.
                    if exc.status_code not in (404, 409):
                        raise
                existing = self._networks_named()
            # Several replicas sharing DOCKER_NETWORK can create it at the same moment
            # (engine 20.10 checks duplicates without a lock), and a name that matches two
            # networks makes every container start fail ("is ambiguous"). All replicas
            # keep the same one, the first created: containers started before the second
            # one appeared are on it. The others are still unused, and removed.
            oldest_first = sorted(existing, key=lambda n: (n.attrs.get("Created", ""), n.id))
            for extra in oldest_first[1:]:
                log.info("removing duplicate Docker network %s (%s)", self.network, extra.id[:12])
                try:
                    extra.remove()
                except (NotFound, APIError) as exc:
                    log.debug("duplicate network %s not removed: %s", extra.id[:12], exc)
            self._network_ready = True

    def _networks_named(self) -> list[Any]:
        return [
            n for n in self.client.networks.list(names=[self.network]) if n.name == self.network
        ]

    # --- helpers ---------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            result = await asyncio.to_thread(fn, *args)
        except ProviderError:
            raise
        except (requests.ConnectionError, requests.Timeout) as exc:
            raise self._unreachable(exc) from exc
        except DockerException as exc:
            if _is_connection_error(exc):
                raise self._unreachable(exc) from exc
            raise ProviderError(f"Docker error: {_explain(exc)}") from exc
        # Any call the engine answered is an answer, as a ping's is (the start-up
        # reconciliation's listing, say): the first acquire after a start needs no
        # look of its own at an engine slow to reach (ssh).
        self._ping_error, self._ping_at = None, time.monotonic()
        return result

    def _unreachable(self, exc: BaseException) -> ProviderUnavailable:
        """Skipped from now on, until a ping (which this makes due) finds it back."""
        tls = _tls_failure(exc)
        error = ProviderUnavailable(
            f"TLS with the Docker engine at {self.where} failed: {tls}"
            if tls
            else f"Docker engine unreachable at {self.where}"
        )
        self._ping_error, self._ping_at = error.message, 0.0
        return error


def _explain(exc: DockerException) -> str:
    if isinstance(exc, APIError):
        return str(exc.explanation or exc)[:500]
    return str(exc)[:500]


def _tls_failure(exc: BaseException) -> str | None:
    """OpenSSL's reason when the connection failed in its TLS handshake (a certificate
    one end does not trust), as the operator must fix it, not wait for it."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return str(seen.reason or seen.strerror or seen)[:200].replace("_", " ").lower()
        seen = seen.__cause__ or seen.__context__
    return None


def _is_connection_error(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (requests.ConnectionError, ConnectionError, FileNotFoundError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return "Connection aborted" in str(exc) or "Connection refused" in str(exc)


def _network_trouble(message: str) -> bool:
    return "is ambiguous" in message or ("network" in message and "not found" in message)


def _remove_quietly(container: Any) -> None:
    try:
        container.remove(force=True)
    except DockerException:
        log.warning("could not remove half-made container %s", container.id[:12])


def _end_in(found: Mapping[str, Any], exit_code: int | None) -> tuple[WorkerDeath, bool]:
    """A container's death by its inspection (`exit_code` when it is gone), and whether it
    may yet be told an OOM kill: SIGKILLed, not said OOM-killed (yet), and there with a
    memory limit of its own (what Docker's OOMKilled speaks of; events.py waits for it)."""
    state = found.get("State") or {}
    code = state.get("ExitCode", exit_code)
    if state.get("OOMKilled"):
        return oom_killed(code), False
    limited = bool((found.get("HostConfig") or {}).get("Memory"))
    return exited(code), code == SIGKILLED and limited


def oom_killed(code: int | None) -> WorkerDeath:
    """A container's death by the kernel's OOM killer, in the words the lease keeps."""
    return WorkerDeath(LostCause.oom_killed, code, "the kernel's OOM killer ended it")


def exited(code: int | None) -> WorkerDeath:
    """A container's death by its exit (or a kill other than the OOM killer's)."""
    return WorkerDeath(LostCause.exited, code, f"its container exited with code {code}")
