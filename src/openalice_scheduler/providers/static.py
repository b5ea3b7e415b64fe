"""static: a fixed pool of worker endpoints that already run (on-premises fleets).

`STATIC_WORKERS="renderer=http://a:8080,http://b:8080;anim=http://c:9000"` — per kind,
optionally per GPU class (`renderer:entry=http://gpu-box:8080`; without a class the
workers serve `gpu=none`). Each endpoint is leased exclusively: the store reserves it as
the lease's resource, so two live leases never share one. The scheduler neither creates
nor destroys these workers; release just returns the endpoint to the pool."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from openalice_scheduler.models import GpuClass, WorkerKind
from openalice_scheduler.providers.base import (
    Availability,
    ProviderStatus,
    Worker,
    WorkerInfo,
    WorkerSpec,
)

_URL = re.compile(r"^https?://[^\s,;]+$")


def parse_static_workers(value: str) -> dict[tuple[WorkerKind, GpuClass], list[str]]:
    """`kind[:gpu]=url,url;...` → pools. Raises ValueError naming the bad part."""
    pools: dict[tuple[WorkerKind, GpuClass], list[str]] = {}
    seen: set[str] = set()
    for group in filter(None, (g.strip() for g in value.split(";"))):
        key, sep, urls = group.partition("=")
        if not sep:
            raise ValueError(f"STATIC_WORKERS: {group!r} is not kind=url,url")
        kind_name, _, gpu_name = key.strip().partition(":")
        try:
            kind = WorkerKind(kind_name.strip())
            gpu = GpuClass(gpu_name.strip() or "none")
        except ValueError:
            raise ValueError(
                f"STATIC_WORKERS: {key.strip()!r} is not kind[:gpu] with kind renderer|anim "
                "and gpu none|entry|mid|high"
            ) from None
        for url in filter(None, (u.strip() for u in urls.split(","))):
            if not _URL.match(url):
                raise ValueError(f"STATIC_WORKERS: {url!r} is not an http(s) URL")
            if url in seen:
                raise ValueError(f"STATIC_WORKERS: {url!r} is listed twice")
            seen.add(url)
            pools.setdefault((kind, gpu), []).append(url)
    if not pools:
        raise ValueError("STATIC_WORKERS: no worker endpoints given")
    return pools


class StaticProvider:
    name = "static"
    max_workers = 0  # each endpoint is its own exclusive resource: that is the cap
    resource_label = "static endpoints"

    def __init__(
        self, workers: str, region: str | None = None, prices: Mapping[str, float] | None = None
    ) -> None:
        # Tuples: handed to every reserve as they are, never copied.
        self.pools = {key: tuple(urls) for key, urls in parse_static_workers(workers).items()}
        self.region = region
        self.prices = dict(prices or {})  # STATIC_PRICE_PER_HOUR per GPU class

    def exclusive_resources(self, spec: WorkerSpec) -> Sequence[str] | None:
        return self.pools.get((spec.kind, spec.gpu), ())

    async def available(self, spec: WorkerSpec) -> Availability:
        if not self.pools.get((spec.kind, spec.gpu)):
            return Availability(False, f"no static {spec.kind} workers for gpu={spec.gpu}")
        if spec.region is not None and spec.region != self.region:
            return Availability(False, f"region {spec.region!r} not served by static workers")
        return Availability(True)

    def assign(self, resource: str | None) -> tuple[str, str]:
        """(endpoint, provider_token) of the worker behind a reserved endpoint. Nothing
        to create or destroy: the service records such a lease in one transaction."""
        assert resource is not None, "the store reserves the endpoint"
        return resource, resource

    async def provision(self, spec: WorkerSpec) -> Worker:
        endpoint, token = self.assign(spec.resource)
        return Worker(endpoint=endpoint, provider_token=token)

    async def release(self, provider_token: str, lease_id: str) -> None:
        return None  # the worker keeps running; its endpoint is free again

    async def list_workers(self) -> Mapping[str, list[WorkerInfo]] | None:
        return None

    async def price(self, spec: WorkerSpec) -> float | None:
        return self.prices.get(spec.gpu.value, 0.0)

    async def status(self) -> ProviderStatus:
        capacity: dict[str, int | None] = {}
        by_kind: dict[str, dict[str, int]] = {}
        for (kind, gpu), urls in self.pools.items():
            capacity[gpu.value] = (capacity.get(gpu.value) or 0) + len(urls)
            by_kind.setdefault(kind.value, {})[gpu.value] = len(urls)
        return ProviderStatus(True, "", capacity, by_kind)

    async def close(self) -> None:
        return None
