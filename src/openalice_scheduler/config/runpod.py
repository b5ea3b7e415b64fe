"""RunPod's settings (docs/backends/runpod.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings


class RunPodSettings(BaseSettings):
    """GPU (and CPU) pods on RunPod: the key, which API, the GPU types of each class, the
    pods' cloud and disk, and how the driver calls RunPod."""

    runpod_api_key: SecretStr | None = Field(
        None,
        description="RunPod's API key (Bearer), never logged or shown; `runpod` without it "
        "is skipped with a warning.",
    )
    runpod_api: Literal["rest", "graphql"] = Field(
        "rest",
        description="RunPod API to drive: rest (REST v2) or graphql (the original driver; "
        "no CPU pods, no catalog).",
    )
    runpod_api_base_url: str = Field(
        "https://api.runpod.io", pattern=r"^https?://", description="RunPod's API base."
    )
    runpod_renderer_template: str | None = Field(
        None, description="A pod template for renderer pods; unset = RENDERER_IMAGE."
    )
    runpod_anim_template: str | None = Field(
        None, description="A pod template for anim pods; unset = ANIM_IMAGE."
    )
    runpod_gpu_entry: str = Field(
        "NVIDIA GeForce RTX 4090,NVIDIA RTX A5000,NVIDIA GeForce RTX 3090",
        description="RunPod GPU type ids for gpu=entry, in order; on REST the catalog's "
        "price and stock order them and skip those without stock.",
    )
    runpod_gpu_mid: str = Field(
        "NVIDIA L40S,NVIDIA RTX 6000 Ada Generation,NVIDIA RTX A6000",
        description="As RUNPOD_GPU_ENTRY, for gpu=mid.",
    )
    runpod_gpu_high: str = Field(
        "NVIDIA H100 80GB HBM3,NVIDIA A100-SXM4-80GB,NVIDIA A100 80GB PCIe",
        description="As RUNPOD_GPU_ENTRY, for gpu=high.",
    )
    runpod_cpu_flavor: str = Field(
        "cpu5c", min_length=1, description="CPU pods for gpu=none (REST only)."
    )
    runpod_cloud: Literal["SECURE", "COMMUNITY"] = Field(
        "SECURE", description="RunPod's cloud the pods are made in."
    )
    runpod_max_pods: int = Field(0, ge=0, description="Cap on live pods; 0 = none.")
    runpod_disk_gb: int = Field(20, ge=1, description="Container disk per pod, in GB.")
    runpod_request_timeout_seconds: float = Field(
        30.0, gt=0, description="Each call to RunPod's API gives up after this long."
    )
    runpod_poll_interval_seconds: float = Field(
        2.0, gt=0, description="How often a starting pod is looked at, until RUNNING."
    )
    runpod_catalog_ttl_seconds: float = Field(
        30.0,
        ge=0,
        description="How long RunPod's catalog (prices, stock) is kept; 0 = asked each time.",
    )
    runpod_ready_timeout_seconds: float = Field(
        900.0,
        ge=0,
        description="How long a RUNNING pod has to pass its readiness probe "
        "(images pull for minutes); 0 = not probed.",
    )
    runpod_proxy_url: str = Field(
        "https://{pod_id}-{port}.proxy.runpod.net",
        pattern=r"^https?://",
        description="A pod's endpoint, where it is also probed: {pod_id} and {port} are filled in.",
    )

    @field_validator("runpod_proxy_url")
    @classmethod
    def _proxy_template(cls, value: str) -> str:
        try:
            value.format(pod_id="p", port=1)
        except (KeyError, IndexError, ValueError):
            raise ValueError("may only use the placeholders {pod_id} and {port}") from None
        return value

    def runpod_gpu_types(self, gpu_class: str) -> list[str]:
        value = {
            "entry": self.runpod_gpu_entry,
            "mid": self.runpod_gpu_mid,
            "high": self.runpod_gpu_high,
        }.get(gpu_class, "")
        return [t.strip() for t in value.split(",") if t.strip()]
