"""How a new worker is probed before its lease is answered, per kind; each provider's
ready timeout is with its own settings
(docs/concepts/readiness-and-loss.md#workers-ready-when-handed-out)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings


class ReadinessSettings(BaseSettings):
    """The readiness probe of each worker kind. How long a worker has to pass it is each
    provider's own setting (LOCAL_DOCKER_, RUNPOD_, MODAL_, K8S_READY_TIMEOUT_SECONDS)."""

    renderer_ready_path: str | None = Field(
        None,
        pattern=r"^(/.*)?$",
        description="HTTP path a renderer worker answers 2xx on once ready; unset = a TCP "
        "connect to its port (behind a proxy or tunnel: any answer of the worker's own).",
    )
    anim_ready_path: str | None = Field(
        None, pattern=r"^(/.*)?$", description="As RENDERER_READY_PATH, for anim workers."
    )

    @property
    def ready_paths(self) -> dict[str, str | None]:
        """Readiness path per worker kind (RENDERER_READY_PATH, ANIM_READY_PATH)."""
        return {"renderer": self.renderer_ready_path or None, "anim": self.anim_ready_path or None}
