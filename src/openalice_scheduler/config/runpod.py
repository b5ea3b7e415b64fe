"""RunPod's settings (README, Workers on RunPod)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings


class RunPodSettings(BaseSettings):
    runpod_api_key: SecretStr | None = None
    runpod_api: Literal["rest", "graphql"] = Field("rest", description="RunPod API to drive.")
    runpod_api_base_url: str = Field("https://api.runpod.io", pattern=r"^https?://")
    runpod_renderer_template: str | None = None
    runpod_anim_template: str | None = None
    runpod_gpu_entry: str = "NVIDIA GeForce RTX 4090,NVIDIA RTX A5000,NVIDIA GeForce RTX 3090"
    runpod_gpu_mid: str = "NVIDIA L40S,NVIDIA RTX 6000 Ada Generation,NVIDIA RTX A6000"
    runpod_gpu_high: str = "NVIDIA H100 80GB HBM3,NVIDIA A100-SXM4-80GB,NVIDIA A100 80GB PCIe"
    runpod_cpu_flavor: str = Field("cpu5c", min_length=1)
    runpod_cloud: Literal["SECURE", "COMMUNITY"] = "SECURE"
    runpod_max_pods: int = Field(0, ge=0, description="Cap on live pods; 0 = none.")
    runpod_disk_gb: int = Field(20, ge=1)
    runpod_request_timeout_seconds: float = Field(30.0, gt=0)
    runpod_poll_interval_seconds: float = Field(2.0, gt=0)
    runpod_catalog_ttl_seconds: float = Field(30.0, ge=0)
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
