"""Caps in money per owner (docs/concepts/money.md#prices-and-caps); each provider's
prices are with its own settings."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings


class MoneySettings(BaseSettings):
    """What an owner's leases may cost: per hour while held, and spent over a day. Prices
    are each provider's own (LOCAL_DOCKER_, STATIC_, K8S_, MODAL_PRICE_PER_HOUR; RunPod's
    catalog)."""

    max_cost_per_hour_per_owner: float = Field(
        0.0,
        ge=0,
        description="USD per hour an owner's live leases may cost together, the new one "
        "included; over it, 429 budget_exceeded. 0 = no cap.",
    )
    max_spend_per_day_per_owner: float = Field(
        0.0,
        ge=0,
        description="USD an owner may have spent over the last 24 h for a new "
        "priced lease to be granted; 0 = no cap.",
    )
    owner_budgets: str | None = Field(
        None,
        description="Per-owner caps replacing the two above, `owner=N/h:N/d,…` "
        "(e.g. `anim=5/h:80/d,live=2/h`); 0 lifts a cap.",
    )

    @field_validator("owner_budgets")
    @classmethod
    def _budgets_syntax(cls, value: str | None) -> str | None:
        from openalice_scheduler.prices import parse_owner_budgets

        parse_owner_budgets(value)
        return value
