"""The service itself: its secret, where it listens, its name, its providers and how it
picks one, and how it starts and stops (docs/operations/startup-errors.md,
docs/operations/drain.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings

MIN_SECRET_LENGTH = 16


class ServiceSettings(BaseSettings):
    """The secret the gated endpoints need, where the service listens, its name, which
    providers it drives and how it picks one, and how it starts and stops."""

    internal_secret: SecretStr = Field(
        description="Shared secret for the gated endpoints (header X-Internal-Secret), at "
        "least 16 characters; the service refuses to start without it."
    )
    scheduler_host: str = Field("0.0.0.0", description="Address to listen on.")
    scheduler_port: int = Field(8080, ge=1, le=65535, description="Port to listen on.")
    scheduler_instance: str = Field(
        "default",
        pattern=r"^[a-z0-9][a-z0-9-]{0,39}$",
        description="This scheduler's name: its workers carry it as a label, so it only "
        "ever touches its own (replicas of one database share it; give each store its own).",
    )
    providers: str = Field(
        "local-docker",
        description="Comma list of providers, in order: local-docker, runpod, modal, "
        "kubernetes, static; an unknown name stops start-up.",
    )
    policy: Literal["ordered-first-available", "cheapest-first"] = Field(
        "ordered-first-available",
        description="How a provider is picked: the first in PROVIDERS order that can serve, "
        "or the cheapest per hour for the GPU class.",
    )
    max_leases_per_owner: int = Field(
        0, ge=0, description="Live leases per owner_id; over it, 429. 0 = no cap."
    )
    scheduler_public_url: str | None = Field(
        None,
        pattern=r"^https?://[^\s/?#]+(/[^\s?#]*)?$",
        description="How workers reach "
        "the scheduler (http://scheduler:8080): each worker is given LEASE_SELF_URL and "
        "LEASE_TOKEN under it, to ask after its own lease; unset = workers are not told.",
    )
    cors_origins: str | None = Field(
        None,
        description="Comma list of origins allowed cross-origin access, `*` for any; unset = none.",
    )
    http_parser: Literal["h11", "httptools"] = Field(
        "h11",
        description="uvicorn's HTTP parser. h11 caps a request's header block "
        "(64 KiB) before it is buffered; httptools costs about half as much per request "
        "but buffers headers of any size: use it only behind a proxy that caps them.",
    )
    startup_timeout_seconds: float = Field(
        60.0,
        ge=0,
        description="How long start-up retries an unreachable PostgreSQL; 0 = try once.",
    )
    shutdown_grace_seconds: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="On SIGTERM: how long requests under way (a "
        "provision, say) have to finish and be answered before the process exits.",
    )

    @field_validator("internal_secret")
    @classmethod
    def _secret_not_empty(cls, value: SecretStr) -> SecretStr:
        secret = value.get_secret_value().strip()
        if not secret:
            raise ValueError("must be set and not empty: gated routes are never served open")
        if len(secret) < MIN_SECRET_LENGTH:
            raise ValueError(
                f"must be at least {MIN_SECRET_LENGTH} characters, got {len(secret)} "
                "(e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        return value

    @field_validator("providers")
    @classmethod
    def _providers_not_empty(cls, value: str) -> str:
        if not [name for name in value.split(",") if name.strip()]:
            raise ValueError("lists no provider; give at least one, e.g. local-docker")
        return value

    @property
    def provider_names(self) -> list[str]:
        return [name.strip() for name in self.providers.split(",") if name.strip()]

    @property
    def cors_origin_list(self) -> list[str]:
        if not self.cors_origins:
            return []
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]
