"""Where in a fleet a lease goes, decided inside the store's reservation transaction
(under the provider's lock, so across replicas) from the resources the provider's other
live leases hold.

Every lease on a fleet host holds one resource key naming its host: `HOST:gpu:DEVICE`
for gpu=entry (the device is exclusive), `HOST:slot:N` otherwise (N, the lowest number
free on that host, only keeps keys distinct). A host's load is the number of keys
naming it, so its cap counts GPU and CPU workers alike, exactly, in one transaction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from openalice_scheduler.capacity import AtCapacity, Placement
from openalice_scheduler.providers.docker.hosts import HostConfig


def gpu_key(host: str, device: str) -> str:
    return f"{host}:gpu:{device}"


def parse_key(resource: str) -> tuple[str, str | None]:
    """(host, GPU device or None) of a resource key made here."""
    host, what, rest = resource.split(":", 2)
    return host, rest if what == "gpu" else None


@dataclass(frozen=True, slots=True)
class Placer:
    """Picks a host among `hosts` (declared order, already filtered by region) for one
    lease: one that answers (not in `down`) with a free slot and, when `gpu`, a free
    GPU; the least loaded first, ties in declared order."""

    hosts: Sequence[HostConfig]
    gpu: bool
    down: frozenset[str] = frozenset()
    # What a worker costs on each host (USD per hour), recorded with the lease.
    prices: Mapping[str, float] = field(default_factory=dict)

    def __call__(self, taken: Set[str]) -> Placement:
        load: dict[str, int] = {}
        for key in taken:
            name = key.split(":", 1)[0]
            load[name] = load.get(name, 0) + 1
        best: Placement | None = None
        best_load = 0
        for host in self.hosts:
            used = load.get(host.name, 0)
            if host.name in self.down or (host.max_workers and used >= host.max_workers):
                continue
            resource = self._free_key(host, taken)
            if resource is not None and (best is None or used < best_load):
                best = Placement(
                    resource=resource, host=host.name, price=self.prices.get(host.name)
                )
                best_load = used
        if best is None:
            raise AtCapacity(self._refusal(load))
        return best

    def _free_key(self, host: HostConfig, taken: Set[str]) -> str | None:
        if self.gpu:
            return next(
                (gpu_key(host.name, d) for d in host.devices if gpu_key(host.name, d) not in taken),
                None,
            )
        slot = 0
        while f"{host.name}:slot:{slot}" in taken:
            slot += 1
        return f"{host.name}:slot:{slot}"

    def _refusal(self, load: dict[str, int]) -> str:
        what = "a free GPU device" if self.gpu else "a free worker slot"
        each = ", ".join(
            f"{h.name} not answering"
            if h.name in self.down
            else f"{h.name} {load.get(h.name, 0)}/{h.max_workers or '∞'}"
            + (f" ({len(h.devices)} GPUs)" if self.gpu else "")
            for h in self.hosts
        )
        return f"no Docker host has {what} ({each})"
