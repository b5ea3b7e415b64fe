"""static: a fixed pool of worker endpoints that already run (on-premises fleets).

`STATIC_WORKERS="renderer=http://a:8080,http://b:8080;anim=http://c:9000"` — per kind,
optionally per GPU class (`renderer:entry=http://gpu-box:8080`; without a class the
workers serve `gpu=none`). Each endpoint is leased exclusively: the store reserves it as
the lease's resource, so two live leases never share one. The scheduler neither creates
nor destroys these workers; release just returns the endpoint to the pool.

Each endpoint is probed every STATIC_PROBE_INTERVAL_SECONDS (`watch`, the kind's probe:
providers/probe.py). One that fails FAILURES_OUT times in a row is out of rotation: no
lease is given it, and the lease holding it, if any, ends `lost` (the death `watch`
yields). It is back in rotation once it passes again. Each replica probes for itself."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Protocol

from openalice_scheduler.models import GpuClass, LostCause, WorkerKind
from openalice_scheduler.providers.base import (
    Availability,
    ProviderStatus,
    Resync,
    Worker,
    WorkerDeath,
    WorkerEnded,
    WorkerInfo,
    WorkerSpec,
)

log = logging.getLogger(__name__)
_URL = re.compile(r"^https?://[^\s,;]+$")
# Probes failed in a row that take an endpoint out of rotation.
FAILURES_OUT = 3


class Checker(Protocol):
    """One attempt of a kind's readiness probe at a URL: None when it answers as ready,
    else what was seen (probe.ReadyProbe)."""

    async def check(self, kind: str, url: str) -> str | None: ...

    async def close(self) -> None: ...


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
        self,
        workers: str,
        region: str | None = None,
        prices: Mapping[str, float] | None = None,
        *,
        checker: Checker | None = None,
        interval: float = 10.0,
    ) -> None:
        # Tuples: handed to every reserve as they are, never copied.
        self.pools = {key: tuple(urls) for key, urls in parse_static_workers(workers).items()}
        self.region = region
        self.prices = dict(prices or {})  # STATIC_PRICE_PER_HOUR per GPU class
        # The endpoints' probe (None: never probed, always in rotation), how often.
        self.checker = checker
        self.interval = interval
        # Endpoints out of rotation, and each endpoint's probes failed in a row.
        self.out: set[str] = set()
        self._failures: dict[str, int] = {}

    def exclusive_resources(self, spec: WorkerSpec) -> Sequence[str] | None:
        urls = self.pools.get((spec.kind, spec.gpu), ())
        return tuple(u for u in urls if u not in self.out) if self.out else urls

    async def available(self, spec: WorkerSpec) -> Availability:
        urls = self.pools.get((spec.kind, spec.gpu))
        if not urls:
            return Availability(False, f"no static {spec.kind} workers for gpu={spec.gpu}")
        if spec.region is not None and spec.region != self.region:
            return Availability(False, f"region {spec.region!r} not served by static workers")
        if self.out.issuperset(urls):
            return Availability(
                False,
                f"every static {spec.kind} worker for gpu={spec.gpu} is out of rotation "
                f"(failing its probe {FAILURES_OUT} times in a row)",
            )
        return Availability(True)

    async def watch(self) -> AsyncIterator[WorkerEnded | Resync]:
        """Each endpoint probed every `interval`: one failing FAILURES_OUT times in a row
        goes out of rotation, and its death is yielded (its lease, if any, is lost)."""
        checker = self.checker
        if checker is None:
            return  # never probed: nothing to hear, ever
        kinds = {url: kind.value for (kind, _), urls in self.pools.items() for url in urls}
        while True:
            problems = await asyncio.gather(*(checker.check(k, u) for u, k in kinds.items()))
            for url, problem in zip(kinds, problems, strict=True):
                if problem is None:
                    self._failures[url] = 0
                    if url in self.out:
                        self.out.discard(url)
                        log.info("static endpoint %s passes its probe again: in rotation", url)
                    continue
                failed = self._failures[url] = self._failures.get(url, 0) + 1
                if failed == FAILURES_OUT:
                    self.out.add(url)
                    log.warning(
                        "static endpoint %s failed its probe %d times in a row (%s): out "
                        "of rotation",
                        url,
                        failed,
                        problem,
                    )
                    why = f"failed its probe {failed} times in a row: {problem}"
                    yield WorkerEnded(None, url, WorkerDeath(LostCause.unknown, detail=why))
            await asyncio.sleep(self.interval)

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
        if self.checker is not None:
            await self.checker.close()
