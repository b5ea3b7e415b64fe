"""Wire types of the contract (SPEC.md): what callers send and what they get back."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    field_validator,
)

MAX_TTL_SECONDS = 8 * 3600
MAX_WAIT_SECONDS = 300
MAX_ENV_ENTRIES = 64
MAX_ENV_VALUE_BYTES = 4096
# What JSON Schema can say of a value's size is characters; UTF-8 takes at most 4 bytes
# for one, so this many always fit in MAX_ENV_VALUE_BYTES (the document says so).
MAX_ENV_VALUE_SAFE_CHARS = MAX_ENV_VALUE_BYTES // 4
ENV_KEY_PATTERN = "^[A-Za-z_][A-Za-z0-9_]*$"
_ENV_KEY = re.compile(ENV_KEY_PATTERN.strip("^$"))


def _whole_number(value: object) -> object:
    # JSON Schema's "integer" admits 60.0, so a whole float is accepted (pydantic then
    # refuses 60.5); a bool or a string is not a number of seconds.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a whole number (60 or 60.0)")
    return value


# Seconds in a JSON body: 60 or 60.0, never true, "60" or 60.5. (The bounds come before
# the check, so that the JSON schema shows them as minimum/maximum.)
WHOLE_NUMBER = BeforeValidator(_whole_number)
TtlSeconds = Annotated[int, Field(ge=1, le=MAX_TTL_SECONDS), WHOLE_NUMBER]
WaitSeconds = Annotated[int, Field(ge=0, le=MAX_WAIT_SECONDS), WHOLE_NUMBER]
# `2026-06-16T01:44:17.123456Z` on the wire (store.records.format_us), a date-time.
Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


def _env_value(value: str) -> str:
    # An error here is named `env.KEY` (its place in the body); the value itself is never
    # repeated, not even in part: env values may be secrets.
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        # A lone surrogate (`"\ud800"` as a JSON escape) is no character: no worker's
        # environment can hold it.
        raise ValueError("not valid Unicode text (a lone UTF-16 surrogate escape)") from None
    if size > MAX_ENV_VALUE_BYTES:
        raise ValueError(f"value is {size} bytes in UTF-8; at most {MAX_ENV_VALUE_BYTES} allowed")
    return value


EnvValue = Annotated[
    str,
    AfterValidator(_env_value),
    # Schema only: the server's rule is the bytes, checked above.
    Field(
        json_schema_extra={
            "maxLength": MAX_ENV_VALUE_SAFE_CHARS,
            "description": f"At most {MAX_ENV_VALUE_BYTES} bytes in UTF-8, which "
            f"maxLength cannot say: {MAX_ENV_VALUE_SAFE_CHARS} characters always fit (4 "
            f"bytes each at most); up to {MAX_ENV_VALUE_BYTES} ASCII characters do too. "
            "Valid Unicode text (no lone surrogate). Never logged, stored or echoed.",
        }
    ),
]


class WorkerKind(StrEnum):
    renderer = "renderer"
    anim = "anim"


class GpuClass(StrEnum):
    none = "none"
    entry = "entry"
    mid = "mid"
    high = "high"


class LeaseState(StrEnum):
    provisioning = "provisioning"
    active = "active"
    releasing = "releasing"
    released = "released"
    failed = "failed"
    # A warm-pool worker, owned by nobody (docs/concepts/pools.md#warm-pools): being made, then
    # ready.
    warming = "warming"
    idle = "idle"
    # Displaced by a caller of a higher class
    # (docs/concepts/priorities.md#priorities-and-preemption): its worker runs until `preempt_at`,
    # then goes.
    preempting = "preempting"


class ReleaseReason(StrEnum):
    explicit = "explicit"
    expired = "expired"
    orphan = "orphan"
    lost = "lost"
    failed = "failed"
    # An idle warm-pool worker destroyed unused: idle too long, surplus, dead, or its
    # room needed by a cold acquire.
    recycled = "recycled"
    # Displaced by a caller of a higher class, after its notice and grace.
    preempted = "preempted"


class LostCause(StrEnum):
    """Why a worker stopped after its hand-out
    (docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out), as its backend tells it:
    its process ended by itself, the kernel's OOM killer ended it, its node (or the kubelet) evicted
    it, its node was lost, the backend's own deadline ended it, or the backend does not say."""

    exited = "exited"
    oom_killed = "oom_killed"
    evicted = "evicted"
    node_lost = "node_lost"
    deadline = "deadline"
    unknown = "unknown"


# A priority class's name (docs/concepts/priorities.md#priorities-and-preemption).
PRIORITY_CLASS_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"

# Caller-given identifiers (owner_id, correlation_id, region): printable ASCII, no spaces
# or control characters. An owner_id then always fits the X-Lease-Owner header (latin-1)
# and can match it, and empty means nothing: "" is refused, not a second kind of "none"
# (it was a way around the owner quota).
TOKEN_PATTERN = r"^[\x21-\x7E]+$"
Token = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=TOKEN_PATTERN)]


class LeaseRequest(BaseModel):
    """Body of `POST /v1/lease`. Unknown fields are ignored, as the contract says."""

    model_config = ConfigDict(extra="ignore")

    kind: WorkerKind
    gpu: GpuClass = GpuClass.none
    correlation_id: Token | None = None
    owner_id: Token | None = None
    region: Annotated[Token, StringConstraints(max_length=64)] | None = None
    ttl_seconds: TtlSeconds = 3600
    env: dict[str, EnvValue] = Field(
        default_factory=dict,
        description="Environment variables for the worker: at most "
        f"{MAX_ENV_ENTRIES}, named like shell variables.",
        # The rules the validators below apply, for clients and fuzzers built from the
        # document (a key's pattern, the number of entries).
        json_schema_extra={
            "maxProperties": MAX_ENV_ENTRIES,
            "propertyNames": {"pattern": ENV_KEY_PATTERN},
        },
    )
    wait_seconds: Annotated[
        WaitSeconds,
        Field(description="How long to wait in line when no provider has capacity now."),
    ] = 0
    priority_class: Annotated[str, StringConstraints(pattern=PRIORITY_CLASS_PATTERN)] | None = (
        Field(
            None,
            description="One of the scheduler's PRIORITY_CLASSES (another is a 422 naming "
            "them); unset: the owner's class (OWNER_PRIORITY_CLASSES), else `default`.",
        )
    )

    @field_validator("env", mode="before")
    @classmethod
    def _env_size(cls, value: object) -> object:
        # Checked before the items are validated, so a 10,000-entry map is refused
        # with one message instead of 10,000 errors.
        if isinstance(value, dict) and len(value) > MAX_ENV_ENTRIES:
            raise ValueError(f"at most {MAX_ENV_ENTRIES} entries allowed, got {len(value)}")
        return value

    @field_validator("env")
    @classmethod
    def _env_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENV_KEY.fullmatch(key):
                raise ValueError(f"key {key[:64]!r} does not match {_ENV_KEY.pattern}")
        return value


class RenewRequest(BaseModel):
    """Body of `POST /v1/lease/{lease_id}/renew`; without it the lease's own TTL."""

    model_config = ConfigDict(extra="ignore")

    ttl_seconds: TtlSeconds | None = None


class Lease(BaseModel):
    """A lease as callers see it. The first eight fields are the original contract."""

    lease_id: str
    provider: str
    kind: WorkerKind
    endpoint: str
    created_at: Timestamp
    expires_at: Timestamp
    provider_token: str
    owner_id: str | None = None
    gpu: GpuClass = GpuClass.none
    correlation_id: str | None = None
    region: str | None = None
    state: LeaseState = LeaseState.active
    release_reason: ReleaseReason | None = None
    released_at: Timestamp | None = None
    host: str | None = Field(
        None,
        description="local-docker with DOCKER_HOSTS: the engine holding the worker; null otherwise",
    )
    fence: int | None = Field(
        None,
        description="Fencing token: strictly increasing over every lease of the "
        "store, kept by renewals; the worker has it as LEASE_FENCE and in its hand-off",
    )
    gpu_type: str | None = Field(
        None,
        description="The GPU type the worker got (RunPod's id, LOCAL_GPU_TYPE for "
        "local Docker); null for gpu=none or when unknown",
    )
    price_per_hour: float | None = Field(
        None,
        description="What the worker costs, USD per hour (docs/concepts/money.md#prices-and-caps); "
        "null when unknown",
    )
    granted_at: Timestamp | None = Field(
        None, description="When the lease became active: its cost counts from then"
    )
    cost: float | None = Field(
        None,
        description="Once ended: price_per_hour × the time from granted_at to "
        "released_at, USD; 0 for a lease never granted; null while live",
    )
    priority_class: str = Field(
        "default",
        description="Its caller's priority class "
        "(docs/concepts/priorities.md#priorities-and-preemption)",
    )
    preempt_at: Timestamp | None = Field(
        None,
        description="While `preempting`: when its worker is destroyed "
        "(docs/concepts/priorities.md#priorities-and-preemption); null otherwise",
    )
    lost_cause: LostCause | None = Field(
        None,
        description="With release_reason `lost` (or a pool worker `recycled` for it): "
        "why its worker stopped; null otherwise",
    )
    exit_code: int | None = Field(
        None, description="With lost_cause: the worker's exit code, when its backend gives one"
    )


class LeaseSelf(BaseModel):
    """`GET /v1/lease/{id}/self`: what a worker may know of its own lease."""

    lease_id: str
    state: LeaseState
    expires_at: Timestamp
    fence: int | None
    preempt_at: Timestamp | None = Field(
        None, description="While `preempting`: when the worker is destroyed"
    )


class AcquireResponse(BaseModel):
    lease: Lease
    provider: str


class GpuUse(BaseModel):
    capacity: int | None = Field(description="Most workers of this class; null = no fixed cap")
    in_use: int


class HostView(BaseModel):
    """One engine of a local-docker fleet (DOCKER_HOSTS) in `GET /v1/providers`."""

    name: str
    healthy: bool
    detail: str = Field("", description="Why the engine cannot be used, when it cannot")
    region: str | None
    max_workers: int | None = Field(description="This host's cap; null = none")
    gpu_devices: list[str] = Field(description="The GPUs it leases for gpu=entry")
    workers: int | None = Field(
        description="Containers of this scheduler on the engine now; null when it does not answer"
    )


class GuardView(BaseModel):
    """A guard watching a provider's workers (docs/concepts/guard.md#the-guard), in
    `GET /v1/providers`."""

    guard_id: str
    last_contact: Timestamp = Field(description="Its last poll of any replica")
    silent_seconds: float = Field(description="Seconds since then")


class Waiting(BaseModel):
    """One caller in `GET /v1/line` (never its `env`)."""

    position: int = Field(description="1: the next caller the admission loop looks at")
    owner_id: str | None
    correlation_id: str | None
    priority_class: str
    kind: WorkerKind
    gpu: GpuClass
    region: str | None = None
    waited_seconds: float
    replica: str = Field(description="The replica the caller waits on")


class PoolView(BaseModel):
    """One warm pool in `GET /v1/pools` (docs/concepts/pools.md#pools-that-follow-demand)."""

    kind: WorkerKind
    gpu: GpuClass
    classes: list[str] | None = Field(description="The classes it serves; null: every class")
    min: int
    max: int
    buffer: int
    max_cost: float | None = Field(description="USD per hour its workers may cost; null: no cap")
    target: int = Field(description="Workers it keeps now (its demand, bounds and money caps)")
    cold_start_seconds: float | None = Field(
        description="The start its target covers: its recent workers' median; null: none yet"
    )
    idle: int
    warming: int
    price_per_hour: float | None = Field(description="A worker's price; null: not known yet")
    cost_per_hour: float | None = Field(description="What its idle and warming workers cost")
    hits_last_hour: int = Field(description="Its callers' requests served by a pool worker")
    misses_last_hour: int = Field(description="Its callers' requests that went cold")


class ProviderView(BaseModel):
    """One provider in `GET /v1/providers`."""

    name: str
    healthy: bool
    detail: str = ""
    max_workers: int | None
    in_use: int
    gpu: dict[GpuClass, GpuUse] = Field(description="Per GPU class, over every kind")
    kinds: dict[WorkerKind, dict[GpuClass, GpuUse]] = Field(
        default_factory=dict,
        description="Per worker kind and GPU class. `capacity` is that kind's own where "
        "the provider splits capacity by kind (static endpoints); null where the kinds "
        "share the GPU class's capacity",
    )
    hosts: list[HostView] | None = Field(
        None, description="local-docker with DOCKER_HOSTS: each engine, in declared order"
    )
    idle: dict[WorkerKind, dict[GpuClass, int]] = Field(
        default_factory=dict,
        description="Idle warm-pool workers (WARM_POOL) per kind and GPU class; they are "
        "counted in `in_use` too, as every cap counts them",
    )
    warming: dict[WorkerKind, dict[GpuClass, int]] = Field(
        default_factory=dict,
        description="Warm-pool workers being made and probed, per kind and GPU class "
        "(counted in `in_use` too)",
    )
    guards: list[GuardView] = Field(
        default_factory=list,
        description="The guards watching this provider's workers "
        "(`openalice-scheduler guard`), with their last contact",
    )


class GuardWorker(BaseModel):
    lease_id: str
    provider: str
    state: LeaseState
    until: Timestamp = Field(
        description="Until when its worker may run: the lease's "
        "expiry, or when it ended for a lease being released"
    )


class GuardPoll(BaseModel):
    """`GET /v1/guard`: what a guard must know to act alone once no scheduler answers."""

    store_id: str
    instance: str
    max_ttl_seconds: int
    now: Timestamp
    workers: list[GuardWorker]


class FieldError(BaseModel):
    field: str
    message: str


class ErrorBody(BaseModel):
    """Every error answer: a stable code, a human message, and the details of its code.
    Codes: unauthorized, forbidden, lease_not_found, not_found, method_not_allowed,
    lease_conflict, duplicate_header, request_timeout, body_too_large, headers_too_large,
    invalid_request, quota_exceeded, budget_exceeded, too_many_guards, provision_failed,
    release_failed, no_provider_available, store_unavailable, shutting_down, not_ready,
    preempting, worker_lost, internal_error (new codes may be added)."""

    model_config = ConfigDict(extra="allow")

    error: str = Field(description="Stable code; see each response for the codes it may carry")
    message: str = Field(description="For humans; may change")
    field: str | None = Field(None, description="invalid_request: the first invalid field")
    errors: list[FieldError] | None = Field(None, description="invalid_request: each field")
    reasons: dict[str, str] | list[str] | None = Field(
        None,
        description="no_provider_available, provision_failed: why, per provider; "
        "not_ready, shutting_down (/readyz): each reason",
    )
    ready: bool | None = Field(None, description="not_ready, shutting_down (/readyz): false")
    failures: dict[str, str] | None = Field(
        None, description="provision_failed: each provider's failure"
    )
    limit: int | None = Field(
        None,
        description="quota_exceeded: leases an owner may hold; too_many_guards: guards "
        "recorded at most (MAX_GUARDS); body_too_large, headers_too_large: bytes",
    )
    header: str | None = Field(None, description="duplicate_header: the repeated header")
    lease_id: str | None = Field(None, description="release_failed: the lease")
    provider: str | None = Field(None, description="release_failed: its provider")
    cause: str | None = Field(None, description="store_unavailable: what failed")
    lost_cause: str | None = Field(
        None, description="worker_lost: why the worker stopped (Lease.lost_cause)"
    )
    exit_code: int | None = Field(None, description="worker_lost: its exit code, when known")


class Health(BaseModel):
    status: str = "ok"
    service: str = "openalice-scheduler"


class Readiness(BaseModel):
    """`GET /readyz` when ready. When not, the answer is a 503 error body (`not_ready`, or
    `shutting_down` while draining) with `ready` false and `reasons`."""

    ready: bool = True


# --- usage (GET /v1/usage; docs/concepts/money.md#usage-and-retention) ---

GroupBy = Literal["owner", "provider", "kind", "gpu"]


class UsageFigures(BaseModel):
    leases: int = Field(description="Leases held for some of the period")
    live: int = Field(description="Those of them still held now")
    lease_hours: float = Field(description="Hours they were held inside the period")
    cost: float = Field(description="USD those hours cost (an unknown price counts 0)")


class UsageGroup(UsageFigures):
    key: str | None = Field(
        description="The owner, provider, kind or GPU class; null for leases without an owner; "
        "`pool`: the warm pools' workers while they waited in a pool"
    )


class UsageReport(BaseModel):
    """`GET /v1/usage`: what leases held during [since, until) cost, per group."""

    since: Timestamp
    until: Timestamp
    group_by: GroupBy
    groups: list[UsageGroup] = Field(description="By cost, highest first")
    total: UsageFigures
    retention_days: int = Field(
        description="Ended leases are purged after this many days (0: never)"
    )
    complete: bool = Field(
        description="False when the period reaches back beyond "
        "retention: purged leases are missing from it"
    )
    note: str | None = Field(description="What is missing, when not complete")
