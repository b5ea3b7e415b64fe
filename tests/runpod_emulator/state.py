"""The emulator's world: pods, stock, prices, queued faults and the call log.

Everything here is plain Python guarded by one lock, because it is touched from two threads:
the server's event loop (handling requests) and the test thread (flipping fault switches and
asserting on calls). Nothing in here awaits, so holding a threading lock is safe and short.

Both APIs (REST v2 and GraphQL) share this one store, as they do at RunPod: a pod created
over GraphQL is listed by `GET /v2/pods` and vice versa.
"""

from __future__ import annotations

import itertools
import math
import secrets
import string
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from .catalog import (
    AVAILABILITY_LEVELS,
    CPU_FLAVORS_BY_ID,
    DATA_CENTERS,
    GPU_TYPES,
    GPU_TYPES_BY_ID,
    data_center_name,
)

# RunPod's own wording for a capacity miss (GraphQL `SUPPLY_CONSTRAINT`); the REST 400 detail
# reuses it, so a driver that matches on "no longer any instances available" works for both.
NO_CAPACITY_MESSAGE = (
    "There are no longer any instances available with the requested specifications. "
    "Please refresh and try again."
)
# What every variant of that message says (RunPod also sends "... with the request
# specifications. Please try again later.").
NO_CAPACITY_WORDS = "no longer any instances available"

LIFECYCLE: tuple[str, ...] = ("PROVISIONING", "STARTING", "RUNNING")
POD_STATUSES: tuple[str, ...] = (*LIFECYCLE, "EXITED", "ERROR", "TERMINATED")

# Operation names as recorded in the call log, with the API-neutral kind a fault may target,
# so one switch ("create") hits both `POST /v2/pods` and `podFindAndDeployOnDemand`.
OPERATION_KINDS: dict[str, str] = {
    "createPod": "create",
    "podFindAndDeployOnDemand": "create",
    "getPod": "read",
    "pod": "read",
    "listPods": "list",
    "myself": "list",
    "deletePod": "terminate",
    "podTerminate": "terminate",
    "listGpuTypes": "catalog",
}
OPERATION_TARGETS: frozenset[str] = frozenset(OPERATION_KINDS) | frozenset(OPERATION_KINDS.values())

_ID_ALPHABET = string.ascii_lowercase + string.digits


def _new_id(length: int = 14) -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))


def _utc_now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


def operation_kind(op: str | None) -> str | None:
    return OPERATION_KINDS.get(op) if op else None


def _check_level(level: str) -> str:
    if level not in AVAILABILITY_LEVELS:
        raise ValueError(f"availability level must be one of {AVAILABILITY_LEVELS}, not {level!r}")
    return level


def _check_target(op: str | None) -> str | None:
    if op is not None and op not in OPERATION_TARGETS:
        raise ValueError(f"unknown operation {op!r}; use one of {sorted(OPERATION_TARGETS)}")
    return op


class PlacementError(Exception):
    """A create the emulator refuses after the body passed schema validation (REST 400).

    `no_capacity` separates "no stock" (GraphQL SUPPLY_CONSTRAINT) from a broken rule; REST
    answers 400 for both and only the detail tells them apart, as RunPod documents.
    """

    def __init__(self, detail: str, *, no_capacity: bool = False) -> None:
        super().__init__(detail)
        self.detail = detail
        self.no_capacity = no_capacity


@dataclass
class Fault:
    """One queued failure: the next `remaining` matching calls answer `status`."""

    status: int
    remaining: int = 1
    op: str | None = None  # operation name or kind; None = any RunPod call
    retry_after: int | None = None  # seconds, sent as `Retry-After` (429 defaults to 1)
    after_create: bool = False  # create the pod first, then answer `status` anyway
    detail: str | None = None  # overrides the default error text

    def matches(self, op: str | None) -> bool:
        return self.op is None or self.op == op or self.op == operation_kind(op)

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "count": self.remaining,
            "op": self.op,
            "retry_after": self.retry_after,
            "after_create": self.after_create,
            "detail": self.detail,
        }


@dataclass
class Call:
    """One request to the RunPod API surface (control endpoints are not recorded).

    The Authorization header is never stored: the driver's promise is that the key appears
    nowhere, and the emulator should not be the one place it leaks to.
    """

    seq: int
    api: str  # "rest" | "graphql"
    method: str
    path: str
    op: str | None  # REST operationId or GraphQL root field; None if unparseable
    status: int | None = None
    pod_id: str | None = None
    body: Any = None
    at: float = field(default_factory=time.time)

    @property
    def kind(self) -> str | None:
        return operation_kind(self.op)

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "api": self.api,
            "method": self.method,
            "path": self.path,
            "op": self.op,
            "kind": self.kind,
            "status": self.status,
            "pod_id": self.pod_id,
            "body": self.body,
            "at": self.at,
        }


@dataclass(frozen=True)
class PodSpec:
    """What a create asks for, already translated from either API's field names."""

    name: str
    image: str
    gpu_id: str | None = None
    gpu_count: int = 1
    cpu_id: str | None = None
    vcpu_count: int = 0
    memory_gb: int | None = None
    cloud: str = "SECURE"  # SECURE | COMMUNITY | ALL (GraphQL only)
    data_center_ids: tuple[str, ...] = ()
    args: str = ""
    disk: int = 50
    ports: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    mounts: dict[str, Any] = field(default_factory=dict)


@dataclass
class Pod:
    """A stored pod. Readers get copies (`replace`) so they never race the server thread."""

    id: str
    name: str
    image: str
    args: str
    disk: int
    ports: tuple[str, ...]
    env: dict[str, str]
    cloud: str
    data_center_id: str
    gpu_id: str | None
    gpu_count: int
    cpu_id: str | None
    vcpu_count: int
    memory_gb: int
    mounts: dict[str, Any]
    cost_per_hr: float
    machine_id: str
    created_at: datetime
    created_mono: float
    status: str = "PROVISIONING"
    pinned: bool = False  # status set by a test; the lifecycle clock no longer moves it
    started_at: datetime | None = None
    started_mono: float | None = None
    uptime: int = 0


class EmulatorState:
    """Thread-safe store plus every fault switch. `RunPodEmulator` adds the HTTP server."""

    def __init__(self, provision_delay: float = 0.0) -> None:
        self._lock = threading.RLock()
        self._initial_provision_delay = provision_delay
        # Sequence numbers survive reset(): a slow request still in flight from the previous
        # test must not annotate (or crash on) a call of the next one.
        self._next_seq = itertools.count(1)
        self._clear()

    # ------------------------------------------------------------------ setup / reset

    def _clear(self) -> None:
        with self._lock:
            self._provision_delay = self._initial_provision_delay
            # Seconds after RUNNING from which a pod's proxy URL answers; None: never
            # (nothing listens on an emulated pod's ports).
            self._answer_after: float | None = None
            self._proxy_hits: dict[str, int] = {}
            self._pods: dict[str, Pod] = {}
            self._vanished: list[str] = []
            self._calls: dict[int, Call] = {}
            self._faults: list[Fault] = []
            self._delays: dict[str | None, float] = {}
            self._no_capacity: set[str] = set()
            self._no_capacity_at_create: set[str] = set()
            self._stock: dict[str, str] = {}
            self._capacity: dict[str, int] = {}
            self._prices: dict[str, tuple[float, float]] = {
                gpu.id: (gpu.price_secure, gpu.price_community) for gpu in GPU_TYPES
            }
            self._data_centers: dict[str, str] = dict(DATA_CENTERS)
            self._dc_stock: dict[str, str] = {}
            self._dc_gpu_stock: dict[tuple[str, str], str] = {}

    def reset(self) -> None:
        """Forget pods, calls and faults; restore the default catalog and provision delay."""
        self._clear()

    # ------------------------------------------------------------------ fault switches

    @property
    def provision_delay(self) -> float:
        """Seconds from create to RUNNING (STARTING from half of it); applies to live pods too."""
        with self._lock:
            return self._provision_delay

    @provision_delay.setter
    def provision_delay(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("provision_delay must be >= 0")
        with self._lock:
            self._provision_delay = float(seconds)

    @property
    def pods_answer_after(self) -> float | None:
        """Seconds after a pod turns RUNNING from which its proxy URL (`proxy_url`)
        answers 200, as a worker that takes that long to listen; None (the default): it
        never answers (502, RunPod's proxy with nothing behind it)."""
        with self._lock:
            return self._answer_after

    @pods_answer_after.setter
    def pods_answer_after(self, seconds: float | None) -> None:
        if seconds is not None and seconds < 0:
            raise ValueError("pods_answer_after must be >= 0 or None")
        with self._lock:
            self._answer_after = None if seconds is None else float(seconds)

    def proxy_answers(self, pod_id: str, port: int) -> bool:
        """Whether the pod's proxy URL for `port` answers now; counts the request."""
        with self._lock:
            self._proxy_hits[pod_id] = self._proxy_hits.get(pod_id, 0) + 1
            pod = self._pods.get(pod_id)
            if pod is None or self._answer_after is None:
                return False
            pod = self._observe(pod)
            declared = f"{port}/http" in pod.ports  # the proxy serves HTTP ports only
            return (
                declared
                and pod.status == "RUNNING"
                and pod.started_mono is not None
                and time.monotonic() - pod.started_mono >= self._answer_after
            )

    def proxy_hits(self, pod_id: str) -> int:
        """Requests a pod's proxy URL has had."""
        with self._lock:
            return self._proxy_hits.get(pod_id, 0)

    def set_no_capacity(self, compute_id: str, enabled: bool = True) -> None:
        """Creates of this GPU type (or CPU flavor) fail for capacity; the catalog shows NONE."""
        with self._lock:
            if enabled:
                self._no_capacity.add(compute_id)
            else:
                self._no_capacity.discard(compute_id)

    def set_no_capacity_at_create(self, compute_id: str, enabled: bool = True) -> None:
        """Creates of this GPU type (or CPU flavor) fail for capacity while the catalog still
        shows its stock: the catalog is no promise, and the last instance can go between a
        look at it and the create (REST 400 / GraphQL SUPPLY_CONSTRAINT, RunPod's words)."""
        with self._lock:
            if enabled:
                self._no_capacity_at_create.add(compute_id)
            else:
                self._no_capacity_at_create.discard(compute_id)

    def set_stock(self, gpu_id: str, level: str) -> None:
        """Stock level the catalog reports for a GPU type everywhere; NONE also refuses creates."""
        with self._lock:
            self._stock[gpu_id] = _check_level(level)

    def set_capacity(self, gpu_id: str, gpus: int | None) -> None:
        """How many GPUs of this type can still be rented (None = unlimited).

        Creates consume it and terminations give it back, so a test can say "only two pods fit".
        """
        with self._lock:
            if gpus is None:
                self._capacity.pop(gpu_id, None)
            else:
                self._capacity[gpu_id] = max(0, int(gpus))

    def set_price(
        self, gpu_id: str, *, secure: float | None = None, community: float | None = None
    ) -> None:
        """USD per hour per GPU, as the catalog quotes it and as new pods are billed."""
        with self._lock:
            old_secure, old_community = self._prices.get(gpu_id, (0.0, 0.0))
            self._prices[gpu_id] = (
                old_secure if secure is None else float(secure),
                old_community if community is None else float(community),
            )

    def set_data_centers(self, dc_ids: Iterable[str]) -> None:
        """Which data centers exist (in placement order); the others vanish from the catalog."""
        with self._lock:
            self._data_centers = {dc: data_center_name(dc) for dc in dc_ids}

    def set_data_center_stock(self, dc_id: str, level: str, gpu_id: str | None = None) -> None:
        """Stock of one data center, for every GPU type or for one of them."""
        with self._lock:
            if gpu_id is None:
                self._dc_stock[dc_id] = _check_level(level)
            else:
                self._dc_gpu_stock[(dc_id, gpu_id)] = _check_level(level)

    def fail_next(
        self,
        status: int,
        count: int = 1,
        *,
        op: str | None = None,
        retry_after: int | None = None,
        after_create: bool = False,
        detail: str | None = None,
    ) -> None:
        """Make the next `count` calls matching `op` answer `status`.

        `op` is an operation name (`createPod`, `podTerminate`, ...) or a kind (`create`,
        `read`, `list`, `terminate`, `catalog`); None hits any call. Faults queue in order.
        `after_create=True` creates the pod and then answers the error (create calls only).
        """
        if not 400 <= status <= 599:
            raise ValueError("fault status must be a 4xx or 5xx code")
        if count < 1:
            raise ValueError("count must be >= 1")
        if after_create:
            op = op or "create"
            if operation_kind(op) != "create" and op != "create":
                raise ValueError("after_create only applies to create operations")
        fault = Fault(status, count, _check_target(op), retry_after, after_create, detail)
        with self._lock:
            self._faults.append(fault)

    def set_delay(self, seconds: float, op: str | None = None) -> None:
        """Answer every call matching `op` (None = all) only after `seconds`."""
        with self._lock:
            if seconds > 0:
                self._delays[_check_target(op)] = float(seconds)
            else:
                self._delays.pop(op, None)

    def vanish_pod(self, pod_id: str) -> bool:
        """Remove a pod behind the caller's back, as when RunPod reclaims it."""
        with self._lock:
            if not self.terminate_pod(pod_id):
                return False
            self._vanished.append(pod_id)
            return True

    def set_pod_status(self, pod_id: str, status: str | None) -> None:
        """Pin a pod's status (e.g. ERROR, EXITED); None hands it back to the lifecycle clock."""
        if status is not None and status not in POD_STATUSES:
            raise ValueError(f"status must be one of {POD_STATUSES}")
        with self._lock:
            pod = self._pods[pod_id]
            if status is None:
                # Back on the clock, which re-derives the status from the pod's age.
                pod.pinned, pod.status = False, "PROVISIONING"
                return
            pod.status, pod.pinned = status, True
            if status == "RUNNING" and pod.started_mono is None:
                pod.started_mono, pod.started_at = time.monotonic(), _utc_now()

    # ------------------------------------------------------------------ call log

    def calls(self, op: str | None = None) -> list[Call]:
        """Recorded calls, oldest first; `op` filters by operation name or kind."""
        with self._lock:
            calls = self._calls.values()
            return [replace(c) for c in calls if op is None or op in (c.op, c.kind)]

    def call_count(self, op: str | None = None) -> int:
        return len(self.calls(op))

    def begin_call(self, api: str, method: str, path: str, op: str | None, body: Any = None) -> int:
        with self._lock:
            seq = next(self._next_seq)
            self._calls[seq] = Call(seq, api, method, path, op, body=body)
            return seq

    def annotate_call(self, seq: int, **changes: Any) -> None:
        with self._lock:
            call = self._calls.get(seq)
            if call is None:  # recorded before a reset(); that log is gone
                return
            for name, value in changes.items():
                setattr(call, name, value)

    def delay_for(self, op: str | None) -> float:
        with self._lock:
            specific = [self._delays.get(op, 0.0), self._delays.get(operation_kind(op), 0.0)]
            return max([self._delays.get(None, 0.0), *specific])

    def take_fault(self, op: str | None) -> Fault | None:
        """Consume one use of the first queued fault that matches `op`."""
        with self._lock:
            for fault in self._faults:
                if fault.matches(op):
                    fault.remaining -= 1
                    if fault.remaining == 0:
                        self._faults.remove(fault)
                    return replace(fault, remaining=1)
            return None

    # ------------------------------------------------------------------ pods

    def create_pod(self, spec: PodSpec) -> Pod:
        """Place and store a pod, or raise PlacementError (REST 400 / GraphQL error)."""
        with self._lock:
            dc_id, cloud = self._place(spec)
            now = time.monotonic()
            pod = Pod(
                id=_new_id(),
                name=spec.name,
                image=spec.image,
                args=spec.args,
                disk=spec.disk,
                ports=spec.ports,
                env=dict(spec.env),
                cloud=cloud,
                data_center_id=dc_id,
                gpu_id=spec.gpu_id,
                gpu_count=spec.gpu_count if spec.gpu_id else 0,
                cpu_id=spec.cpu_id,
                vcpu_count=self._vcpus(spec),
                memory_gb=self._memory(spec),
                mounts=dict(spec.mounts),
                cost_per_hr=self._hourly_cost(spec, cloud),
                machine_id=_new_id(12),
                created_at=_utc_now(),
                created_mono=now,
            )
            self._pods[pod.id] = pod
            if spec.gpu_id in self._capacity:
                self._capacity[spec.gpu_id] -= spec.gpu_count
            # The create answer always shows PROVISIONING, as RunPod's does, whatever the delay.
            return replace(pod)

    def get_pod(self, pod_id: str) -> Pod | None:
        with self._lock:
            pod = self._pods.get(pod_id)
            return self._observe(pod) if pod else None

    def list_pods(self) -> list[Pod]:
        with self._lock:
            return [self._observe(pod) for pod in self._pods.values()]

    def terminate_pod(self, pod_id: str) -> bool:
        """Delete a pod; False when it is unknown or already gone (REST 404)."""
        with self._lock:
            pod = self._pods.pop(pod_id, None)
            if pod is None:
                return False
            self._release_capacity(pod)
            return True

    # ------------------------------------------------------------------ catalog

    def data_centers(self) -> dict[str, str]:
        with self._lock:
            return dict(self._data_centers)

    def price(self, gpu_id: str) -> tuple[float, float]:
        with self._lock:
            return self._prices.get(gpu_id, (0.0, 0.0))

    def availability(
        self, compute_id: str, dc_id: str, *, count: int = 1, cloud: str = "SECURE"
    ) -> str:
        """Stock level of a GPU type (or CPU flavor) in one data center for this request."""
        with self._lock:
            if dc_id not in self._data_centers or compute_id in self._no_capacity:
                return "NONE"
            gpu = GPU_TYPES_BY_ID.get(compute_id)
            if gpu is not None and count > gpu.max_count(cloud):
                return "NONE"
            if self._capacity.get(compute_id, math.inf) < count:
                return "NONE"
            if (dc_id, compute_id) in self._dc_gpu_stock:
                return self._dc_gpu_stock[(dc_id, compute_id)]
            if dc_id in self._dc_stock:
                return self._dc_stock[dc_id]
            return self._stock.get(compute_id, "HIGH")

    # ------------------------------------------------------------------ snapshot

    def faults_snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "provision_delay": self._provision_delay,
                "pods_answer_after": self._answer_after,
                "no_capacity": sorted(self._no_capacity),
                "no_capacity_at_create": sorted(self._no_capacity_at_create),
                "stock": dict(self._stock),
                "capacity": dict(self._capacity),
                "price": {
                    gpu: {"secure": secure, "community": community}
                    for gpu, (secure, community) in self._prices.items()
                },
                "data_centers": list(self._data_centers),
                "data_center_stock": dict(self._dc_stock),
                "data_center_gpu_stock": [
                    {"data_center_id": dc, "gpu_id": gpu, "level": level}
                    for (dc, gpu), level in self._dc_gpu_stock.items()
                ],
                "fail_next": [fault.as_dict() for fault in self._faults],
                "delays": {op or "*": seconds for op, seconds in self._delays.items()},
                "vanished_pods": list(self._vanished),
            }

    # ------------------------------------------------------------------ internals

    def _observe(self, pod: Pod) -> Pod:
        """Advance the lifecycle clock, then hand out a copy.

        Status only moves forward: shortening the delay releases waiting pods at once, and
        lengthening it never sends an already seen RUNNING pod back to PROVISIONING.
        """
        now = time.monotonic()
        if not pod.pinned:
            elapsed = now - pod.created_mono
            delay = self._provision_delay
            target = (
                "RUNNING"
                if elapsed >= delay
                else ("STARTING" if elapsed >= delay / 2 else "PROVISIONING")
            )
            if LIFECYCLE.index(target) > LIFECYCLE.index(pod.status):
                pod.status = target
                if target == "RUNNING":
                    pod.started_mono, pod.started_at = now, _utc_now()
        started = pod.started_mono if pod.status == "RUNNING" else None
        pod.uptime = int(now - started) if started is not None else 0
        return replace(pod, env=dict(pod.env), mounts=dict(pod.mounts))

    def _place(self, spec: PodSpec) -> tuple[str, str]:
        """Pick (data center, cloud) the way RunPod does: exactly this compute, no fallback."""
        compute_id = self._check_compute(spec)
        wanted = list(spec.data_center_ids) or list(self._data_centers)
        existing = [dc for dc in wanted if dc in self._data_centers]
        if not existing:
            raise PlacementError(f"data center(s) {', '.join(wanted)} not found")
        if compute_id in self._no_capacity_at_create:
            raise PlacementError(NO_CAPACITY_MESSAGE, no_capacity=True)
        clouds = ("SECURE", "COMMUNITY") if spec.cloud == "ALL" else (spec.cloud,)
        count = spec.gpu_count if spec.gpu_id else 1
        for cloud in clouds:
            for dc in existing:
                if self.availability(compute_id, dc, count=count, cloud=cloud) != "NONE":
                    return dc, cloud
        raise PlacementError(NO_CAPACITY_MESSAGE, no_capacity=True)

    def _check_compute(self, spec: PodSpec) -> str:
        if spec.gpu_id is not None:
            gpu = GPU_TYPES_BY_ID.get(spec.gpu_id)
            if gpu is None:
                raise PlacementError(f"unknown GPU type {spec.gpu_id!r}")
            cloud = "SECURE" if spec.cloud == "ALL" else spec.cloud
            if spec.gpu_count > gpu.max_count(cloud):
                raise PlacementError(
                    f"gpu.count {spec.gpu_count} exceeds the maximum of "
                    f"{gpu.max_count(cloud)} for {gpu.id} on {cloud}"
                )
            return gpu.id
        assert spec.cpu_id is not None
        if spec.cpu_id not in CPU_FLAVORS_BY_ID:
            raise PlacementError(f"unknown CPU flavor {spec.cpu_id!r}")
        if spec.vcpu_count & (spec.vcpu_count - 1):
            raise PlacementError("cpu.vcpuCount must be a power of two")
        return spec.cpu_id

    def _hourly_cost(self, spec: PodSpec, cloud: str) -> float:
        if spec.gpu_id is not None:
            secure, community = self._prices.get(spec.gpu_id, (0.0, 0.0))
            per_gpu = secure if cloud == "SECURE" else community
            return round(per_gpu * spec.gpu_count, 4)
        flavor = CPU_FLAVORS_BY_ID[spec.cpu_id or ""]
        return round(flavor.price_per_vcpu * spec.vcpu_count, 4)

    @staticmethod
    def _vcpus(spec: PodSpec) -> int:
        return spec.vcpu_count if spec.cpu_id else max(spec.vcpu_count, 8 * spec.gpu_count)

    @staticmethod
    def _memory(spec: PodSpec) -> int:
        if spec.cpu_id is not None:
            return CPU_FLAVORS_BY_ID[spec.cpu_id].memory_per_vcpu_gb * spec.vcpu_count
        return max(spec.memory_gb or 0, 31 * spec.gpu_count)

    def _release_capacity(self, pod: Pod) -> None:
        if pod.gpu_id in self._capacity:
            self._capacity[pod.gpu_id] += pod.gpu_count
