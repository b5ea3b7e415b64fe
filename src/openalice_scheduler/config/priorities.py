"""Callers with priorities (docs/concepts/priorities.md#priorities-and-preemption): the
classes, the owners' classes, the grace a preempted lease gets, and how long the line may
grow."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings

from openalice_scheduler.priorities import (
    PriorityClass,
    parse_owner_classes,
    parse_priority_classes,
)


class PrioritySettings(BaseSettings):
    """The priority classes callers name, each owner's class, the grace a preempted
    lease's worker gets, and how long the waiting line may grow."""

    priority_classes: str | None = Field(
        None,
        description="name=value[:preempts][:preemptible], comma list (e.g. "
        "live=100:preempts,default=50,anim=10:preemptible); unset: one class `default`.",
    )
    owner_priority_classes: str | None = Field(
        None,
        description="owner=class, comma list: an owner's class when a request names none, "
        "and the highest class it may name (a higher one: 403 class_not_allowed).",
    )
    unlisted_owner_max_class: str = Field(
        "default",
        description="The highest class an owner not in OWNER_PRIORITY_CLASSES (or a "
        "request without owner_id) may name.",
    )
    line_aging_seconds: float = Field(
        120.0,
        gt=0,
        le=86_400,
        description="Each full period a caller has waited in line moves it one class up "
        "in the line's order (never above the highest; it preempts only as its own class).",
    )
    preemption_grace_seconds: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="How long a preempted lease's worker keeps running after its notice.",
    )
    max_waiting_callers: int = Field(
        1000,
        ge=0,
        le=1_000_000,
        description="Callers one replica lets wait in line at once; the next one is "
        "answered 503 line_full.",
    )
    max_waiting_per_owner: int | None = Field(
        None,
        ge=0,
        description="Callers of one owner waiting at once, per replica; unset: half of "
        "MAX_WAITING_CALLERS.",
    )

    @field_validator("priority_classes")
    @classmethod
    def _classes(cls, value: str | None) -> str | None:
        parse_priority_classes(value)
        return value

    @model_validator(mode="after")
    def _owner_classes(self) -> PrioritySettings:
        parse_owner_classes(self.owner_priority_classes, self.priority_table)
        if self.unlisted_owner_max_class not in self.priority_table:
            raise ValueError(
                f"UNLISTED_OWNER_MAX_CLASS: {self.unlisted_owner_max_class[:32]!r} is not a "
                f"class of PRIORITY_CLASSES ({', '.join(sorted(self.priority_table))})"
            )
        return self

    @property
    def priority_table(self) -> dict[str, PriorityClass]:
        """PRIORITY_CLASSES by name."""
        return parse_priority_classes(self.priority_classes)

    @property
    def owner_classes(self) -> dict[str, str]:
        """OWNER_PRIORITY_CLASSES as {owner: class}."""
        return parse_owner_classes(self.owner_priority_classes, self.priority_table)

    @property
    def waiting_per_owner(self) -> int:
        if self.max_waiting_per_owner is not None:
            return self.max_waiting_per_owner
        return self.max_waiting_callers // 2
