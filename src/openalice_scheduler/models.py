"""Wire types of the contract (SPEC.md): what callers send and what they get back."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

MAX_TTL_SECONDS = 8 * 3600
MAX_WAIT_SECONDS = 300
MAX_ENV_ENTRIES = 64
MAX_ENV_VALUE_BYTES = 4096
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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


LIVE_STATES = (LeaseState.provisioning, LeaseState.active, LeaseState.releasing)


class ReleaseReason(StrEnum):
    explicit = "explicit"
    expired = "expired"
    orphan = "orphan"
    lost = "lost"
    failed = "failed"


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
    ttl_seconds: Annotated[int, Field(ge=1, le=MAX_TTL_SECONDS, strict=True)] = 3600
    env: dict[str, str] = Field(default_factory=dict)
    wait_seconds: Annotated[
        int,
        Field(ge=0, le=MAX_WAIT_SECONDS, strict=True,
              description="How long to wait in line when no provider has capacity now."),
    ] = 0

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
    def _env_entries(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not _ENV_KEY.fullmatch(key):
                raise ValueError(f"key {key[:64]!r} does not match [A-Za-z_][A-Za-z0-9_]*")
            size = len(item.encode())
            if size > MAX_ENV_VALUE_BYTES:
                # Name the key, never the value: env values may be secrets.
                raise ValueError(
                    f"value of {key!r} is {size} bytes; at most {MAX_ENV_VALUE_BYTES} allowed"
                )
        return value


class RenewRequest(BaseModel):
    """Body of `POST /v1/lease/{lease_id}/renew`; without it the lease's own TTL."""

    model_config = ConfigDict(extra="ignore")

    ttl_seconds: Annotated[int, Field(ge=1, le=MAX_TTL_SECONDS, strict=True)] | None = None


class Lease(BaseModel):
    """A lease as callers see it. The first eight fields are the original contract."""

    lease_id: str
    provider: str
    kind: WorkerKind
    endpoint: str
    created_at: str
    expires_at: str
    provider_token: str
    owner_id: str | None = None
    gpu: GpuClass = GpuClass.none
    correlation_id: str | None = None
    region: str | None = None
    state: LeaseState = LeaseState.active
    release_reason: ReleaseReason | None = None
    released_at: str | None = None


class AcquireResponse(BaseModel):
    lease: Lease
    provider: str


class GpuUse(BaseModel):
    capacity: int | None = Field(description="Most workers of this class; null = no fixed cap")
    in_use: int


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


class ErrorBody(BaseModel):
    """Every error answer: a stable code, a human message, and details per code."""

    model_config = ConfigDict(extra="allow")

    error: str
    message: str


class Health(BaseModel):
    status: str = "ok"
    service: str = "openalice-scheduler"


def rfc3339(moment: datetime) -> str:
    """`2026-06-16T01:44:17.123456Z`: always UTC, always microseconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
