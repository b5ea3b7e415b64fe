"""The guard (`openalice-scheduler guard`) and what the scheduler keeps of the guards
that poll it (docs/concepts/guard.md#the-guard)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings


class GuardSettings(BaseSettings):
    """MAX_GUARDS and GUARD_FORGET_SECONDS are the scheduler's; the others the guard's
    own (the scheduler ignores them)."""

    max_guards: int = Field(
        64,
        ge=1,
        le=100_000,
        description="Most guards the scheduler records; a new one past it is a 429 "
        "too_many_guards, the known ones poll on.",
    )
    guard_forget_seconds: float = Field(
        86_400.0,
        ge=1,
        description="A guard silent this long is forgotten (its row and its metric "
        "series); keep it well above the SchedulerGuardSilent alert's 5 minutes.",
    )
    guard_scheduler_url: str | None = Field(
        None,
        pattern=r"^https?://[^,\s]+(,https?://[^,\s]+)*$",
        description="The guard: comma list of the scheduler replicas' base URLs it polls "
        "(required by `guard`).",
    )
    guard_id: str | None = Field(
        None,
        pattern=r"^[\x21-\x2b\x2d-\x7e]{1,128}$",
        description="The guard's name in GET /v1/providers; unset = its host name.",
    )
    guard_poll_seconds: float = Field(
        10.0, gt=0, le=3600, description="The guard: how often it polls a scheduler."
    )
    guard_silence_seconds: float = Field(
        60.0,
        gt=0,
        description="The guard: how long no scheduler must have answered before it acts.",
    )
    guard_grace_seconds: float = Field(
        30.0,
        ge=0,
        description="The guard: how long past a lease's last known end its worker may run.",
    )
    guard_state_file: str = Field(
        "./openalice-guard.json",
        min_length=1,
        description="The guard: where it keeps what it learned, across its own restarts "
        "(put it on a volume).",
    )
