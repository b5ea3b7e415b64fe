"""local-docker on the one engine of DOCKER_HOST (DOCKER_HOSTS unset): workers as
containers, GPU devices of LOCAL_GPU_DEVICES leased exclusively."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace

import docker

from openalice_scheduler.config import Settings
from openalice_scheduler.models import GpuClass
from openalice_scheduler.prices import parse_prices
from openalice_scheduler.providers.base import (
    Availability,
    ProviderStatus,
    Resync,
    Worker,
    WorkerEnded,
    WorkerInfo,
    WorkerSpec,
)
from openalice_scheduler.providers.docker.engine import DockerEngine
from openalice_scheduler.providers.docker.events import deaths


class LocalDockerProvider:
    name = "local-docker"
    resource_label = "GPU devices"

    def __init__(self, settings: Settings, client: docker.DockerClient | None = None) -> None:
        self.max_workers = settings.local_docker_max_workers
        self.region = settings.local_docker_region
        self.devices = settings.gpu_devices
        self.engine = DockerEngine(
            settings, settings.docker_host or "unix:///var/run/docker.sock", client=client
        )
        self.images = self.engine.images
        self.prices = parse_prices(settings.local_docker_price_per_hour)
        self.gpu_type = settings.local_gpu_type

    def exclusive_resources(self, spec: WorkerSpec) -> Sequence[str] | None:
        return list(self.devices) if spec.gpu == GpuClass.entry else None

    async def available(self, spec: WorkerSpec) -> Availability:
        if spec.gpu in (GpuClass.mid, GpuClass.high):
            return Availability(False, f"gpu={spec.gpu} is not served by local Docker")
        if spec.gpu == GpuClass.entry and not self.devices:
            return Availability(False, "gpu=entry needs LOCAL_GPU_DEVICES; this host has none")
        if spec.region is not None and spec.region != self.region:
            where = f"region {self.region!r}" if self.region else "no region"
            return Availability(
                False, f"region {spec.region!r} not served (local Docker is in {where})"
            )
        error = await self.engine.error()
        if error:
            return Availability(False, error)
        return Availability(True)

    async def provision(self, spec: WorkerSpec) -> Worker:
        worker = await self.engine.provision(spec, spec.resource)
        return replace(worker, gpu_type=None if spec.gpu == GpuClass.none else self.gpu_type)

    async def release(self, provider_token: str, lease_id: str) -> None:
        await self.engine.release(provider_token, lease_id)

    async def list_workers(self) -> Mapping[str, list[WorkerInfo]]:
        return await self.engine.list_workers()

    def watch(self) -> AsyncIterator[WorkerEnded | Resync]:
        return deaths(self.engine)

    async def price(self, spec: WorkerSpec) -> float | None:
        return self.prices[spec.gpu.value]  # LOCAL_DOCKER_PRICE_PER_HOUR

    async def status(self) -> ProviderStatus:
        error = await self.engine.error(fresh=True)  # a fresh look, not the cached one
        cap = self.max_workers or None
        capacity: dict[str, int | None] = {GpuClass.none.value: cap}
        if self.devices:
            capacity[GpuClass.entry.value] = min(len(self.devices), cap or len(self.devices))
        return ProviderStatus(healthy=error is None, detail=error or "", capacity=capacity)

    async def close(self) -> None:
        await self.engine.close()
