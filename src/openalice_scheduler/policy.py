"""Provider selection: the order in which providers are tried for a request."""

from __future__ import annotations

from collections.abc import Sequence

from openalice_scheduler.providers import Provider, WorkerSpec


class OrderedFirstAvailable:
    """Walk providers in PROVIDERS order; the service takes the first available one and
    falls through to the next when provisioning fails."""

    name = "ordered-first-available"

    def order(self, providers: Sequence[Provider], spec: WorkerSpec) -> list[Provider]:
        return list(providers)


POLICIES = {OrderedFirstAvailable.name: OrderedFirstAvailable}


def build_policy(name: str) -> OrderedFirstAvailable:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"POLICY: unknown policy {name!r}; valid: {', '.join(POLICIES)}") from None
