"""What `GET /v1/providers` shows of one provider: health, and capacity and use per GPU
class, and per worker kind × GPU class; for a fleet, each host's as its provider saw it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from openalice_scheduler.models import GpuClass, LeaseState
from openalice_scheduler.providers import Provider, ProviderStatus
from openalice_scheduler.store.guards import GuardContact
from openalice_scheduler.store.pool import PoolCount
from openalice_scheduler.times import format_us

_GPU_ORDER = [g.value for g in GpuClass]


def provider_view(
    provider: Provider,
    status: ProviderStatus,
    held: Sequence[tuple[str, str, str, str | None, int]],
    pooled: Sequence[PoolCount] = (),
    guards: Sequence[GuardContact] = (),
    now: int = 0,
) -> dict[str, Any]:
    """`held`: (provider, kind, gpu, owner, count) of the live leases of every provider;
    `pooled`: warm-pool workers by state, whose idle ones are shown apart; `guards`:
    the guards watching this provider, shown with how long each has been silent at
    `now` (µs)."""
    pool: dict[str, dict[str, dict[str, int]]] = {LeaseState.idle: {}, LeaseState.warming: {}}
    for pool_count in pooled:
        if pool_count.provider == provider.name and pool_count.state in pool:
            per_kind = pool[pool_count.state].setdefault(pool_count.kind, {})
            per_kind[pool_count.gpu] = per_kind.get(pool_count.gpu, 0) + pool_count.count
    by_gpu: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {}
    for name, kind, gpu, _owner, count in held:
        if name == provider.name:
            by_gpu[gpu] = by_gpu.get(gpu, 0) + count
            per_kind = by_kind.setdefault(kind, {})
            per_kind[gpu] = per_kind.get(gpu, 0) + count
    kinds = set(by_kind) | set(status.by_kind or {})
    hosts = {} if status.hosts is None else {"hosts": status.hosts}
    return {
        "name": provider.name,
        "healthy": status.healthy,
        "detail": status.detail,
        "max_workers": provider.max_workers or None,
        "in_use": sum(by_gpu.values()),
        "gpu": _use(status.capacity, by_gpu),
        # Per kind: the capacity of that kind alone, where the provider splits it by
        # kind (static endpoints); null where the kinds share the GPU class's capacity.
        "kinds": {
            kind: _use(
                (status.by_kind or {}).get(kind, dict.fromkeys(status.capacity)),
                by_kind.get(kind, {}),
            )
            for kind in sorted(kinds)
        },
        "idle": pool[LeaseState.idle],
        "warming": pool[LeaseState.warming],
        "guards": [
            {
                "guard_id": g.guard_id,
                "last_contact": format_us(g.last_contact_at),
                "silent_seconds": round(max(0, now - g.last_contact_at) / 1e6, 1),
            }
            for g in guards
        ],
        **hosts,
    }


def _use(capacity: dict[str, Any], in_use: dict[str, int]) -> dict[str, dict[str, Any]]:
    return {
        gpu: {"capacity": capacity.get(gpu), "in_use": in_use.get(gpu, 0)}
        for gpu in sorted(set(capacity) | set(in_use), key=_GPU_ORDER.index)
    }
