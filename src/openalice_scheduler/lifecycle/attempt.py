"""One try at a lease for a request, as it goes from supply to supply (acquiring.py):
what it asks, and what each provider answered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from openalice_scheduler.models import LeaseRequest
from openalice_scheduler.providers import WorkerSpec
from openalice_scheduler.store import LeaseRecord, NewLease, OverBudget
from openalice_scheduler.store.records import Budget


@dataclass(eq=False)
class Attempt:
    request: LeaseRequest
    spec: WorkerSpec
    new: NewLease
    budget: Budget | None
    # Its caller's priority class.
    priority_class: str
    # Why a provider could not serve (unavailable, at capacity, over the owner's caps).
    reasons: dict[str, str] = field(default_factory=dict)
    # What a provider tried and failed at.
    failures: dict[str, str] = field(default_factory=dict)
    over_budget: list[OverBudget] = field(default_factory=list)
    at_capacity: bool = False
    # Room was there, but callers wait in line: this one joins them.
    behind: bool = False
    # This lease's row exists (a provider was tried): the next one moves it.
    written: bool = False
    # The providers that could serve it at all (its kind, GPU class, region), in the
    # policy's order.
    eligible: list[str] = field(default_factory=list)
    # A worker was made for it cold (a warm pool's miss is counted once).
    cold: bool = False


class Supply(Protocol):
    """Where an acquire may get its worker: the warm pool, a provider that makes one, a
    provider whose workers already run."""

    async def obtain(self, attempt: Attempt) -> LeaseRecord | None:
        """The lease for `attempt`, active; None when this supply cannot serve it, with
        why noted in the attempt. Raises OverQuota and DuplicateRequest as a reservation
        does (they end the attempt, whoever would serve)."""
        ...
