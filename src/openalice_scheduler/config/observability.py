"""Logs, metrics and traces (docs/operations/logs.md, docs/operations/metrics.md,
docs/operations/traces.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

KNOWN_LOG_LEVELS = ("trace", "debug", "info", "warn", "warning", "error", "off")


class ObservabilitySettings(BaseSettings):
    """What the service logs and how, what /metrics shows, where traces go."""

    rust_log: str | None = Field(
        None,
        description="Log filter, e.g. `warn` or `warn,openalice_scheduler=debug` (the "
        "original service's name for it); unset: LOG_LEVEL, else info.",
    )
    log_level: str | None = Field(None, description="As RUST_LOG, when that is unset.")
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text: one line per record for people; json: one JSON object "
        "per line, with lease, request and trace ids as fields.",
    )
    metrics_owner_series: bool = Field(
        False,
        description="Serve scheduler_owner_leases{owner} and "
        "scheduler_owner_spend_dollars_total{owner}: owner ids on the ungated /metrics.",
    )
    otel_exporter_otlp_endpoint: str | None = Field(
        None,
        description="OTLP/gRPC collector for traces, e.g. http://otel-collector:4317; "
        "unset = no traces.",
    )
    otel_service_name: str = Field(
        "openalice-scheduler", description="The traces' resource service.name."
    )

    @field_validator("rust_log", "log_level")
    @classmethod
    def _log_filter(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        for part in value.split(","):
            level = part.split("=", 1)[-1].strip().lower()
            if level not in KNOWN_LOG_LEVELS:
                known = ", ".join(KNOWN_LOG_LEVELS)
                raise ValueError(f"unknown level {level!r}; use one of {known}")
        return value

    @property
    def log_filter(self) -> str:
        return self.rust_log or self.log_level or "info"
