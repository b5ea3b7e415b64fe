"""What a placement decides, below both the providers that place (a local-docker fleet
picks a device and a host) and the store whose reserving transaction runs the placement
(store/reserving.py): where a lease goes, or that there is no room for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a placed lease goes: the resource it holds, on which host."""

    resource: str
    host: str
    # What a worker costs there, USD per hour (None: the provider's price).
    price: float | None = None


class AtCapacity(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
