"""Modal's settings (docs/backends/modal.md#workers-on-modal)."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings

# What MODAL_PRICE_PER_HOUR is when unset, USD per hour: Modal's published per-second
# rates (modal.com/pricing as of 2025; this host cannot reach it to check again) for a
# sandbox of 1 physical core (0.0000131 $/s) and 2 GiB (0.00000222 $/GiB/s), about
# 0.063 $/h, plus its GPU: L4 0.000222 $/s, L40S 0.000542 $/s, H100 0.001097 $/s.
MODAL_DEFAULT_PRICES = "none=0.063,entry=0.86,mid=2.01,high=4.01"
# Modal ends a sandbox at its `timeout`, at most 24 hours.
MODAL_MAX_TIMEOUT_S = 86_400


class ModalSettings(BaseSettings):
    """Modal sandboxes: the token, the app, each kind's image and command, the GPU type
    of each class, the cap, prices, the sandbox's own deadline and its readiness."""

    modal_token_id: str | None = Field(
        None,
        description="Modal's token id; `modal` without both it and MODAL_TOKEN_SECRET is "
        "skipped with a warning.",
    )
    modal_token_secret: SecretStr | None = Field(
        None, description="Modal's token secret: never logged, stored or shown."
    )
    modal_app_name: str = Field(
        "openalice-scheduler",
        min_length=1,
        max_length=64,
        description="The Modal app the sandboxes belong to (looked up, made if missing).",
    )
    modal_renderer_image: str = Field(
        "openalice-demo-worker:latest", min_length=1, description="A registry reference."
    )
    modal_anim_image: str = Field(
        "openalice-demo-worker:latest",
        min_length=1,
        description="The anim worker's image, as MODAL_RENDERER_IMAGE.",
    )
    modal_renderer_command: str = Field(
        "/bin/sh /entry.sh",
        min_length=1,
        description="What the sandbox runs (Modal runs no CMD of an image): shell words.",
    )
    modal_anim_command: str = Field(
        "/bin/sh /entry.sh", min_length=1, description="As MODAL_RENDERER_COMMAND, for anim."
    )
    modal_gpu_types: str = Field(
        "entry=L4,mid=L40S,high=H100",
        description="Modal's GPU type per GPU class; `none` runs on CPU.",
    )
    modal_max_sandboxes: int = Field(0, ge=0, description="Cap on live sandboxes; 0 = none.")
    modal_price_per_hour: str = Field(
        MODAL_DEFAULT_PRICES,
        description="USD per hour per GPU class (Modal's published per-second rates for 1 "
        "core, 2 GiB and the GPU).",
    )
    modal_sandbox_timeout_seconds: int = Field(
        MODAL_MAX_TIMEOUT_S,
        ge=60,
        le=MODAL_MAX_TIMEOUT_S,
        description="The deadline Modal itself enforces on every sandbox, counted from its "
        "creation: the longest a lease on Modal may live, renewals included.",
    )

    modal_ready_timeout_seconds: float = Field(
        300.0,
        ge=0,
        description="How long a new sandbox, once running, has to pass its readiness "
        "probe through its tunnel (an image's server may take minutes to start); "
        "0 = not probed.",
    )

    modal_start_timeout_seconds: float = Field(
        180.0,
        ge=1,
        description="How long a new sandbox may take to start and report its tunnel: "
        "Modal queues a sandbox it cannot place yet (a GPU type in short supply) instead "
        "of refusing it. Past this the sandbox is terminated and the next provider "
        "tried (alone: a 503 naming the wait). 180 s waits out a short queue yet gives "
        "a caller who has another provider its worker there rather than after Modal's "
        "own 21 minutes, and leaves most of PROVISION_TIMEOUT_SECONDS (600) to the "
        "worker's readiness. The wait also ends a little before "
        "PROVISION_TIMEOUT_SECONDS when that comes first, with Modal's reason.",
    )
    modal_registry_secret: str | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="The name of a Modal secret holding a private registry's "
        "credentials (REGISTRY_USERNAME and REGISTRY_PASSWORD; or AWS_* for ECR; or "
        "SERVICE_ACCOUNT_JSON for Google's registry), for pulling every kind's image. "
        "The scheduler names it only: its values stay in Modal.",
    )

    @field_validator("modal_gpu_types")
    @classmethod
    def _gpu_types(cls, value: str) -> str:
        parse_gpu_types(value)
        return value

    def modal_gpu_type(self, gpu_class: str) -> str | None:
        """Modal's GPU type for `gpu_class` (None: CPU, or not served)."""
        return parse_gpu_types(self.modal_gpu_types).get(gpu_class)


def parse_gpu_types(value: str) -> dict[str, str]:
    """`entry=L4,mid=L40S,high=H100` as {class: type}. ValueError naming the bad part."""
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        cls, sep, gpu = (x.strip() for x in part.partition("="))
        if not sep or cls not in ("entry", "mid", "high") or not gpu:
            raise ValueError(
                f"{part[:64]!r} is not class=TYPE with a class of entry, mid or high "
                "(e.g. entry=L4,mid=L40S,high=H100)"
            )
        found[cls] = gpu
    return found
