"""local-docker over a fleet of Docker engines (DOCKER_HOSTS).

Each lease is placed on one host in the store's reservation transaction (placement.py),
so that per-host caps and GPU exclusivity hold across replicas; the host is recorded as
the lease's `host`, and its provider token is `HOST/CONTAINER-ID`, so that a release
reaches that host's engine. An engine that does not answer is skipped at once: its
health is cached and looked at again in the background (DockerEngine.health)."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence, Set
from dataclasses import replace
from pathlib import Path
from typing import Any

from docker.tls import TLSConfig

from openalice_scheduler.capacity import Placement
from openalice_scheduler.config import Settings
from openalice_scheduler.errors import ProviderError, ProviderUnavailable
from openalice_scheduler.models import GpuClass
from openalice_scheduler.prices import parse_prices
from openalice_scheduler.providers.base import (
    Availability,
    PartialListing,
    ProviderStatus,
    Resync,
    Worker,
    WorkerEnded,
    WorkerInfo,
    WorkerSpec,
)
from openalice_scheduler.providers.docker.engine import DockerEngine
from openalice_scheduler.providers.docker.events import deaths
from openalice_scheduler.providers.docker.hosts import HostConfig
from openalice_scheduler.providers.docker.placement import Placer, parse_key

log = logging.getLogger(__name__)
# How long an acquire waits for an engine's answer when its last one is old (a dead
# socket answers at once; a host that drops packets is then skipped until its ping,
# which goes on in the background, times out). An engine known down is not waited for.
LOOK_S = 1.0


class DockerFleetProvider:
    name = "local-docker"
    resource_label = "GPU devices"

    def __init__(self, settings: Settings, hosts: Sequence[HostConfig]) -> None:
        self.hosts = list(hosts)
        self.class_prices = parse_prices(settings.local_docker_price_per_hour)
        self.gpu_type = settings.local_gpu_type
        self.engines = {h.name: DockerEngine(settings, h.address, tls=_tls(h)) for h in self.hosts}
        # The per-host caps are counted by the placer; this total is what
        # `GET /v1/providers` shows.
        capped = all(h.max_workers for h in self.hosts)
        self.max_workers = sum(h.max_workers for h in self.hosts) if capped else 0

    def exclusive_resources(self, spec: WorkerSpec) -> Sequence[str] | None:
        return None  # the placer takes devices, per host

    def placer(self, spec: WorkerSpec) -> Callable[[Set[str]], Placement]:
        serving = self._serving(spec)
        down = frozenset(h.name for h in serving if self.engines[h.name].last_error())
        return Placer(
            serving,
            gpu=spec.gpu == GpuClass.entry,
            down=down,
            prices={h.name: self._price_on(h, spec) for h in serving},
        )

    async def available(self, spec: WorkerSpec) -> Availability:
        if spec.gpu in (GpuClass.mid, GpuClass.high):
            return Availability(False, f"gpu={spec.gpu} is not served by local Docker")
        serving = self._serving(spec)
        if not serving:
            return Availability(False, self._none_serves(spec))
        errors = await asyncio.gather(*(self.engines[h.name].health(LOOK_S) for h in serving))
        if all(errors):
            return Availability(
                False,
                "no Docker host answers: "
                + "; ".join(f"{h.name}: {e}" for h, e in zip(serving, errors, strict=True)),
            )
        return Availability(True)

    async def provision(self, spec: WorkerSpec) -> Worker:
        assert spec.resource is not None, "placed by the store"
        host, device = parse_key(spec.resource)
        worker = await self.engines[host].provision(spec, device)
        return replace(
            worker,
            provider_token=f"{host}/{worker.provider_token}",
            gpu_type=None if device is None else self.gpu_type,
        )

    async def release(self, provider_token: str, lease_id: str) -> None:
        if provider_token:
            host, _, container_id = provider_token.partition("/")
            engine = self.engines.get(host)
            if engine is None:
                raise ProviderError(f"Docker host {host!r} of this worker is not in DOCKER_HOSTS")
            await engine.release(container_id, lease_id)
            return
        # A provision cut short: its worker, if any, may be on any host that answers. One
        # made on a host that does not answer is an orphan there for reconciliation,
        # once the host is back (it carries this scheduler's labels).
        answering = [e for e in self.engines.values() if e.last_error() is None]
        outcomes = await asyncio.gather(
            *(e.release("", lease_id) for e in answering), return_exceptions=True
        )
        _raise_first(outcomes)

    async def list_workers(self) -> Mapping[str, list[WorkerInfo]]:
        """Every host's workers; a PartialListing when some host could not be listed
        (reconciliation then leaves its leases be). No host listed: ProviderUnavailable."""
        listings = await asyncio.gather(
            *(e.list_workers() for e in self.engines.values()), return_exceptions=True
        )
        unlisted = frozenset(
            host
            for host, listing in zip(self.engines, listings, strict=True)
            if isinstance(listing, ProviderUnavailable)
        )
        if len(unlisted) == len(self.engines):
            _raise_first(listings)
        _raise_first([o for o in listings if not isinstance(o, ProviderUnavailable)])
        found: dict[str, list[WorkerInfo]] = defaultdict(list)
        for host, listing in zip(self.engines, listings, strict=True):
            if isinstance(listing, BaseException):
                continue
            for lease_id, infos in listing.items():
                found[lease_id] += [
                    replace(i, provider_token=f"{host}/{i.provider_token}") for i in infos
                ]
        return PartialListing(found, unlisted) if unlisted else found

    async def watch(self) -> AsyncIterator[WorkerEnded | Resync]:
        """Every host's deaths, as each engine streams them (a host that does not answer
        streams nothing until it does: its Resync then has its deaths listed)."""
        merged: asyncio.Queue[WorkerEnded | Resync] = asyncio.Queue()

        async def follow(host: str, engine: DockerEngine) -> None:
            async for heard in deaths(engine):
                if isinstance(heard, WorkerEnded):
                    token = f"{host}/{heard.provider_token}"
                    heard = WorkerEnded(heard.lease_id, token, heard.death)
                await merged.put(heard)

        followers = [asyncio.create_task(follow(h, e)) for h, e in self.engines.items()]
        try:
            while True:
                yield await merged.get()
        finally:
            for follower in followers:
                follower.cancel()
            await asyncio.gather(*followers, return_exceptions=True)

    async def price(self, spec: WorkerSpec) -> float | None:
        """The cheapest answering host's; the lease records its own host's (placer)."""
        prices = [
            self._price_on(h, spec)
            for h in self._serving(spec)
            if self.engines[h.name].last_error() is None
        ]
        return min(prices) if prices else None

    def _price_on(self, host: HostConfig, spec: WorkerSpec) -> float:
        return self.class_prices[spec.gpu.value] if host.price is None else host.price

    async def status(self) -> ProviderStatus:
        errors = await asyncio.gather(*(e.look() for e in self.engines.values()))
        down = [
            f"{name}: {error}" for name, error in zip(self.engines, errors, strict=True) if error
        ]
        capped = all(h.max_workers for h in self.hosts)
        capacity: dict[str, int | None] = {
            GpuClass.none.value: sum(h.max_workers for h in self.hosts) if capped else None
        }
        if any(h.devices for h in self.hosts):
            capacity[GpuClass.entry.value] = sum(
                min(len(h.devices), h.max_workers or len(h.devices)) for h in self.hosts
            )
        return ProviderStatus(
            healthy=len(down) < len(self.hosts),
            detail="; ".join(down),
            capacity=capacity,
            hosts=await self._host_views(errors),
        )

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines.values()))

    async def _host_views(self, errors: Sequence[str | None]) -> list[dict[str, Any]]:
        async def workers(host: HostConfig, error: str | None) -> int | None:
            if error:
                return None
            try:
                listing = await self.engines[host.name].list_workers()
            except ProviderError:
                return None
            return sum(len(infos) for infos in listing.values())

        counts = await asyncio.gather(
            *(workers(h, e) for h, e in zip(self.hosts, errors, strict=True))
        )
        return [
            {
                "name": h.name,
                "healthy": error is None,
                "detail": error or "",
                "region": h.region,
                "max_workers": h.max_workers or None,
                "gpu_devices": list(h.devices),
                "workers": count,
            }
            for h, error, count in zip(self.hosts, errors, counts, strict=True)
        ]

    def _serving(self, spec: WorkerSpec) -> list[HostConfig]:
        """The hosts that could serve `spec` at all, in declared order."""
        return [
            h
            for h in self.hosts
            if (spec.region is None or h.region == spec.region)
            and (spec.gpu != GpuClass.entry or h.devices)
        ]

    def _none_serves(self, spec: WorkerSpec) -> str:
        if spec.region is not None and not any(h.region == spec.region for h in self.hosts):
            regions = sorted({h.region for h in self.hosts if h.region})
            return (
                f"region {spec.region!r} not served (Docker hosts are in "
                f"{', '.join(map(repr, regions)) or 'no region'})"
            )
        where = f" in region {spec.region!r}" if spec.region else ""
        return f"gpu=entry needs a Docker host with gpus=; none{where} has any"


def _tls(host: HostConfig) -> TLSConfig | None:
    if host.tls_dir is None:
        return None
    where = Path(host.tls_dir)
    return TLSConfig(
        client_cert=(str(where / "cert.pem"), str(where / "key.pem")),
        ca_cert=str(where / "ca.pem"),
        verify=True,
    )


def _raise_first(outcomes: Sequence[object]) -> None:
    """Every host was tried; the first failure (unreachable first) is raised."""
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    for failure in sorted(failures, key=lambda f: not isinstance(f, ProviderUnavailable)):
        raise failure
