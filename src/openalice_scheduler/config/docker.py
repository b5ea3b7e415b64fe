"""Workers on Docker: the images, ports and network of every worker kind, and the local
engine or the fleet of engines that runs them (docs/backends/docker.md#local-docker)."""

from __future__ import annotations

import re
import shutil
import subprocess
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings


class DockerSettings(BaseSettings):
    """The worker image and port of each kind (local-docker's, and the defaults of other
    providers' ports), the network, the engine or fleet of engines, its GPUs, cap, region
    and price."""

    renderer_image: str = Field(
        "openalice-demo-worker:latest",
        description="The renderer worker's image (on the engine already: it is not pulled).",
    )
    anim_image: str = Field(
        "openalice-demo-worker:latest", description="The anim worker's image, as RENDERER_IMAGE."
    )
    renderer_port: int = Field(
        8080, ge=1, le=65535, description="The port a renderer worker serves on, every backend."
    )
    anim_port: int = Field(
        8080, ge=1, le=65535, description="The port an anim worker serves on, every backend."
    )
    docker_network: str = Field(
        "openalice", min_length=1, description="The network workers join (created if missing)."
    )
    docker_host: str | None = Field(
        None, description="The Docker SDK's own: the engine to use; unset = the local socket."
    )
    local_gpu_devices: str | None = Field(
        None,
        description="Comma list of GPU ids for gpu=entry, one per lease, exclusively; "
        "unset = what nvidia-smi lists.",
    )
    local_gpu_type: str | None = Field(
        None,
        max_length=64,
        description="The GPU type local Docker's GPU workers get "
        "(e.g. NVIDIA GeForce RTX 4090), recorded as their leases' gpu_type.",
    )
    local_docker_max_workers: int = Field(0, ge=0, description="Cap on live containers; 0 = none.")
    local_docker_region: str | None = Field(
        None, description="Region local Docker places in; unset = only requests without region."
    )
    local_docker_price_per_hour: str = Field(
        "0",
        description="What a local-docker worker costs, USD per hour: one price, or "
        "per GPU class `none=0.05,entry=0.4`; a DOCKER_HOSTS host's price= replaces it.",
    )
    local_docker_ready_timeout_seconds: float = Field(
        60.0,
        ge=0,
        description="How long a new container has to pass its readiness probe; "
        "0 = not probed (handed out once started).",
    )
    docker_hosts: str | None = Field(
        None,
        description="A fleet of Docker engines for local-docker, `name=address "
        "option=value …` separated by `;` "
        "(docs/backends/docker.md#a-fleet-of-docker-hosts); unset = the one engine of "
        "DOCKER_HOST.",
    )

    @field_validator("docker_host")
    @classmethod
    def _docker_address(cls, value: str | None) -> str | None:
        # What the Docker SDK accepts here (without paramiko for ssh://); it would refuse
        # anything else only when the provider is built.
        if not value:
            return value
        scheme, sep, rest = value.partition("://")
        try:
            port = urlsplit(value).port
        except ValueError:
            port = None
        if (
            not sep
            or scheme not in ("unix", "tcp", "http", "https")
            or not rest
            or (scheme != "unix" and port is None)
        ):
            raise ValueError(
                "must be unix:///path/to/docker.sock or tcp://host:port "
                "(http:// and https:// also work)"
            )
        return value

    @field_validator("local_gpu_devices")
    @classmethod
    def _gpu_ids(cls, value: str | None) -> str | None:
        for device in (value or "").split(","):
            if device.strip() and not re.fullmatch(r"[A-Za-z0-9-]+", device.strip()):
                raise ValueError(f"{device.strip()!r} is not a GPU index or UUID")
        return value

    @property
    def gpu_devices(self) -> list[str]:
        if self.local_gpu_devices is None:
            return _nvidia_smi_devices()
        return [d.strip() for d in self.local_gpu_devices.split(",") if d.strip()]

    @property
    def worker_images(self) -> dict[str, str]:
        """Image per worker kind (RENDERER_IMAGE, ANIM_IMAGE)."""
        return {"renderer": self.renderer_image, "anim": self.anim_image}

    @property
    def worker_ports(self) -> dict[str, int]:
        """Port a worker serves on, per kind (RENDERER_PORT, ANIM_PORT)."""
        return {"renderer": self.renderer_port, "anim": self.anim_port}


def _nvidia_smi_devices() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return re.findall(r"^GPU (\d+):", out, flags=re.MULTILINE)
