"""One try at a lease for a request, as it goes from supply to supply (acquiring.py):
what it asks, and what each provider answered."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from openalice_scheduler.lifecycle.line import Waiter
from openalice_scheduler.models import LeaseRequest
from openalice_scheduler.providers import Provider, WorkerSpec
from openalice_scheduler.store import LeaseRecord, NewLease, OverBudget
from openalice_scheduler.store.records import Budget, Terms


@dataclass(eq=False)
class Attempt:
    request: LeaseRequest
    spec: WorkerSpec
    new: NewLease
    budget: Budget | None
    # Where its caller stands in the line (its priority, its arrival).
    caller: Waiter
    # Why a provider could not serve (unavailable, at capacity, over the owner's caps).
    reasons: dict[str, str] = field(default_factory=dict)
    # What a provider tried and failed at.
    failures: dict[str, str] = field(default_factory=dict)
    over_budget: list[OverBudget] = field(default_factory=list)
    at_capacity: bool = False
    # This lease's row exists (a provider was tried): the next one moves it.
    written: bool = False
    # The providers that could serve it at all (its kind, GPU class, region), and those
    # of them that were full, with their terms (where a preemption may make room).
    eligible: list[str] = field(default_factory=list)
    full: list[tuple[Provider, Terms]] = field(default_factory=list)


class Supply(Protocol):
    """Where an acquire may get its worker: the warm pool, a provider that makes one, a
    provider whose workers already run."""

    async def obtain(self, attempt: Attempt) -> LeaseRecord | None:
        """The lease for `attempt`, active; None when this supply cannot serve it, with
        why noted in the attempt. Raises OverQuota and DuplicateRequest as a reservation
        does (they end the attempt, whoever would serve)."""
        ...
