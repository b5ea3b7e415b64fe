"""Provider selection: the order in which providers are tried for a request. The service
takes the first available provider in that order and falls through to the next when
provisioning fails."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from openalice_scheduler.providers import Provider, WorkerSpec


class Policy(Protocol):
    name: str

    async def order(self, providers: Sequence[Provider], spec: WorkerSpec) -> list[Provider]: ...


class OrderedFirstAvailable:
    """PROVIDERS order, as configured."""

    name = "ordered-first-available"

    async def order(self, providers: Sequence[Provider], spec: WorkerSpec) -> list[Provider]:
        return list(providers)


class CheapestFirst:
    """Lowest price per hour for this GPU class first (Docker and static cost 0; RunPod
    from its catalog); ties, and providers without a price, keep PROVIDERS order."""

    name = "cheapest-first"

    async def order(self, providers: Sequence[Provider], spec: WorkerSpec) -> list[Provider]:
        prices = []
        for index, provider in enumerate(providers):
            price = await provider.price(spec)
            prices.append((math.inf if price is None else price, index, provider))
        return [provider for *_, provider in sorted(prices, key=lambda p: p[:2])]


POLICIES: dict[str, type[OrderedFirstAvailable] | type[CheapestFirst]] = {
    OrderedFirstAvailable.name: OrderedFirstAvailable,
    CheapestFirst.name: CheapestFirst,
}


def build_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"POLICY: unknown policy {name!r}; valid: {', '.join(POLICIES)}") from None
