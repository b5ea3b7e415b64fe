"""What the emulator knows: apps, images, secrets, sandboxes, its switches, its clock and
the calls it answered. Plain data, changed only on the server's event loop.

What is recorded of a sandbox is what was asked (image, GPU type string, cpu, memory,
timeout, tags, exposed ports, command) and the *names* of its environment keys: the
values stay in `SandboxRecord.env`, which no view (`as_dict`, the control API) shows.
"""

from __future__ import annotations

import asyncio
import fnmatch
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from grpclib import Status
from modal_proto import api_pb2

from .tunnels import Tunnel

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
GenericStatus = api_pb2.GenericResult.GenericStatus


def new_id(prefix: str, length: int = 22) -> str:
    """`<prefix>-` and `length` base62 characters: Modal's shape of object ids."""
    return f"{prefix}-" + "".join(secrets.choice(_BASE62) for _ in range(length))


def new_sandbox_id(api: str) -> str:
    """V1 ids are `sb-` + 22 base62 characters (the client routes by that shape); any
    other shape is a V2 sandbox for the client, so V2 ids are longer."""
    return new_id("sb", 22 if api == "v1" else 26)


def new_task_id(api: str) -> str:
    """A V2 sandbox's task id ends in `V` (the client checks it); a V1 one does not."""
    body = new_id("ta", 21)
    return body + ("V" if api == "v2" else "t")


def result_dict(result: api_pb2.GenericResult | None) -> dict[str, Any] | None:
    """A result as the client reads it: `returncode` is the client's own mapping
    (modal 1.6.4, `sandbox/_common.py` `_result_returncode`: TIMEOUT 124, TERMINATED 137,
    anything else its `exitcode`, so 137 for a kernel OOM kill)."""
    if result is None:
        return None
    if result.status == GenericStatus.GENERIC_STATUS_TIMEOUT:
        returncode = 124
    elif result.status == GenericStatus.GENERIC_STATUS_TERMINATED:
        returncode = 137
    else:
        returncode = result.exitcode
    return {
        "status": GenericStatus.Name(result.status).removeprefix("GENERIC_STATUS_"),
        "returncode": returncode,
        "exception": result.exception or None,
    }


@dataclass
class PortRequest:
    port: int
    encrypted: bool
    h2: bool


@dataclass
class SandboxRecord:
    sandbox_id: str
    api: str  # "v1" (SandboxCreate, the GPU path) or "v2" (SandboxCreateV2)
    app_id: str
    environment: str
    created_at: float  # the emulator's clock
    image_id: str
    image: str
    command: list[str] | None
    gpu: str | None
    gpu_count: int
    cpu: float | None
    cpu_max: float | None
    memory_mb: int | None
    memory_max_mb: int | None
    timeout_secs: int
    idle_timeout_secs: int | None
    name: str | None
    regions: list[str]
    workdir: str | None
    tags: dict[str, str]
    ports: list[PortRequest]
    env: dict[str, str] = field(repr=False)
    state: str = "pending"  # pending -> running -> ended
    placed: bool = False  # given a place (scheduling or running); False while queued
    task_id: str = ""  # given once its container runs
    result: api_pb2.GenericResult | None = None
    started_at: float | None = None  # the emulator's clock, once its container runs
    ended_at: float | None = None
    oom_kill_asked: bool = False  # `oom_kill`: the container's end is an OOM kill
    container_id: str | None = None
    address: str | None = None
    tunnels: list[Tunnel] = field(default_factory=list)
    started: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    ended: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    gone: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # tunnels, container
    scheduling: asyncio.Task[None] | None = field(default=None, repr=False)  # its start

    @property
    def deadline(self) -> float | None:
        """When its timeout ends it, counted from its start: a queued or scheduling
        sandbox has no task yet for the timeout to run on. Modal documents a Function's
        timeout as execution time, "It does not include scheduling time"
        (https://modal.com/docs/guide/timeouts), and a sandbox's `timeout` as its
        "maximum lifetime" (https://modal.com/docs/guide/sandbox, Timeouts)."""
        if self.started_at is None:
            return None
        return self.started_at + self.timeout_secs

    def as_dict(self) -> dict[str, Any]:
        """What was asked and what became of it; env *keys* only."""
        return {
            "sandbox_id": self.sandbox_id,
            "api": self.api,
            "app_id": self.app_id,
            "environment": self.environment,
            "created_at": self.created_at,
            "image_id": self.image_id,
            "image": self.image,
            "command": self.command,
            "gpu": self.gpu,
            "gpu_count": self.gpu_count,
            "cpu": self.cpu,
            "cpu_max": self.cpu_max,
            "memory_mb": self.memory_mb,
            "memory_max_mb": self.memory_max_mb,
            "timeout_secs": self.timeout_secs,
            "idle_timeout_secs": self.idle_timeout_secs,
            "name": self.name,
            "regions": self.regions,
            "workdir": self.workdir,
            "tags": dict(self.tags),
            "ports": [vars(p) for p in self.ports],
            "env_keys": sorted(self.env),
            "state": self.state,
            "queued": self.state == "pending" and not self.placed,
            "task_id": self.task_id or None,
            "result": result_dict(self.result),
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "container_id": self.container_id,
            "tunnels": [t.as_dict() for t in self.tunnels],
        }


@dataclass
class Fault:
    """The next `calls` calls of the RPCs matching `rpc` (fnmatch: `SandboxTerminate*`
    is both versions) answer `status`. A call is what the user made once: the client's
    retries of it carry the same `x-idempotency-key` and fail too. With `per_attempt`,
    each attempt counts (the client's retries can then get through)."""

    rpc: str
    status: Status
    calls: int
    message: str
    per_attempt: bool = False
    claimed: set[str] = field(default_factory=set)

    def matches(self, rpc: str) -> bool:
        return fnmatch.fnmatchcase(rpc, self.rpc)

    def applies(self, rpc: str, idempotency_key: str | None) -> bool:
        """Whether this attempt fails (and count it)."""
        if not self.matches(rpc):
            return False
        if not self.per_attempt and idempotency_key and idempotency_key in self.claimed:
            return True
        if self.calls <= 0:
            return False
        self.calls -= 1
        if idempotency_key and not self.per_attempt:
            self.claimed.add(idempotency_key)
        return True

    def as_dict(self) -> dict[str, Any]:
        return {
            "rpc": self.rpc,
            "status": self.status.name,
            "calls_left": self.calls,
            "message": self.message,
            "per_attempt": self.per_attempt,
        }


@dataclass
class Call:
    rpc: str
    status: str  # OK or a gRPC status name
    at: float  # real time
    attempt: int
    idempotency_key: str | None
    sandbox_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass
class Settings:
    """The switches (control API `POST /_emulator/settings`, README)."""

    schedule_delay: float = 0.0  # seconds from create to a running container
    hold_tunnels: bool = False  # running sandboxes' tunnels are not reported
    no_capacity: set[str] = field(default_factory=set)  # GPU types; "*" all, "" CPU-only
    max_sandboxes: int | None = None  # sandboxes placed at once; more wait in the queue
    list_page_size: int = 100
    rpc_delay: dict[str, float] = field(default_factory=dict)  # fnmatch pattern -> seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "schedule_delay": self.schedule_delay,
            "hold_tunnels": self.hold_tunnels,
            "no_capacity": sorted(self.no_capacity),
            "max_sandboxes": self.max_sandboxes,
            "list_page_size": self.list_page_size,
            "rpc_delay": dict(self.rpc_delay),
        }


@dataclass
class App:
    app_id: str
    name: str
    environment: str


@dataclass
class Image:
    image_id: str
    reference: str
    error: str | None  # why it cannot run here (not local, unsupported commands)
    # A private registry's credentials: the kind (`REGISTRY_AUTH_TYPE_…`) and the secret
    # holding them (`Image.from_registry(tag, secret=…)`); the secret's values stay here.
    registry_auth: str | None = None
    registry_secret_id: str | None = None
    built_at: float | None = None  # real time its build finished (`calls[].at`'s clock)


class EmulatorState:
    def __init__(self, token_id: str, token_secret: str) -> None:
        self.token_id = token_id
        self.token_secret = token_secret
        self.settings = Settings()
        self.faults: list[Fault] = []
        self.calls: list[Call] = []
        self.clock_offset = 0.0
        self.clock_frozen_at: float | None = None  # real time when the clock was frozen
        self.apps: dict[tuple[str, str], App] = {}
        self.images: dict[str, Image] = {}
        self.secrets: dict[str, dict[str, str]] = {}
        self.named_secrets: dict[tuple[str, str], str] = {}
        self.sandboxes: dict[str, SandboxRecord] = {}
        self._last_created = 0.0

    # --- the clock ---------------------------------------------------------------------

    def now(self) -> float:
        """The emulator's clock: real time moved forward by `advance_clock`. Frozen
        (`freeze_clock`), real time no longer moves it: only `advance_clock` does, so a
        move ends exactly the sandboxes it reaches, however long the test took."""
        base = time.time() if self.clock_frozen_at is None else self.clock_frozen_at
        return base + self.clock_offset

    def freeze_clock(self, frozen: bool) -> None:
        """Stop (or restart) real time's part in the clock; the clock never jumps."""
        if frozen and self.clock_frozen_at is None:
            self.clock_frozen_at = time.time()
        elif not frozen and self.clock_frozen_at is not None:
            self.clock_offset += self.clock_frozen_at - time.time()
            self.clock_frozen_at = None

    def creation_time(self) -> float:
        """Strictly increasing creation times (list pages are cut at `before_timestamp`)."""
        stamp = max(self.now(), self._last_created + 1e-6)
        self._last_created = stamp
        return stamp

    # --- faults ------------------------------------------------------------------------

    def take_fault(self, rpc: str, idempotency_key: str | None) -> Fault | None:
        for fault in self.faults:
            if fault.applies(rpc, idempotency_key):
                return fault
        return None

    def rpc_delay(self, rpc: str) -> float:
        return max(
            (s for p, s in self.settings.rpc_delay.items() if fnmatch.fnmatchcase(rpc, p)),
            default=0.0,
        )

    def capacity_refusal(self, gpu: str | None) -> str | None:
        """Why a create is refused at once (`no_capacity`: RESOURCE_EXHAUSTED), or None.
        A sandbox past `max_sandboxes` is not refused: it is queued (`has_room`)."""
        refused = self.settings.no_capacity
        if "*" in refused or (gpu or "") in refused:
            what = f"GPU type {gpu}" if gpu else "CPU sandboxes"
            return f"No capacity available for {what} at the moment. Please try again later."
        return None

    def has_room(self) -> bool:
        """Whether one more sandbox can be placed (`max_sandboxes`)."""
        limit = self.settings.max_sandboxes
        placed = sum(1 for s in self.sandboxes.values() if s.placed and s.state != "ended")
        return limit is None or placed < limit

    # --- views -------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Everything for the tests to read; no secret value and no token secret."""
        return {
            "token_id": self.token_id,
            "clock": {
                "now": self.now(),
                "offset": self.clock_offset,
                "frozen": self.clock_frozen_at is not None,
            },
            "settings": self.settings.as_dict(),
            "faults": [f.as_dict() for f in self.faults],
            "apps": [vars(a) for a in self.apps.values()],
            "images": [vars(i) for i in self.images.values()],
            "secrets": [
                {"secret_id": sid, "keys": sorted(env)} for sid, env in self.secrets.items()
            ],
            "sandboxes": [s.as_dict() for s in self.sandboxes.values()],
            "calls": [c.as_dict() for c in self.calls],
        }
