"""The background loops' cadences (docs/concepts/lifecycle.md)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings


class LoopSettings(BaseSettings):
    """How often the sweeper and the reconciler run, and how long a provision may take."""

    sweep_interval_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="The sweeper's cadence: expired leases and releases to retry (it also "
        "wakes at the next known expiry).",
    )
    reconcile_interval_seconds: float = Field(
        60.0,
        gt=0,
        le=86400,
        description="How often store and backends are compared (orphans, crashed "
        "provisions, vanished workers); on Modal and RunPod, the bound on noticing a "
        "worker that stopped.",
    )
    provision_timeout_seconds: float = Field(
        600.0, gt=0, description="A provision taking longer fails (its worker destroyed)."
    )
