"""What the store hands out: lease records, the terms of a reservation, the outcomes a
reservation can refuse with, and the one mapping from a stored lease to its wire shape
(`models.Lease`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass, fields
from typing import Any

from openalice_scheduler.capacity import AtCapacity, Placement
from openalice_scheduler.models import Lease, LeaseState
from openalice_scheduler.store.schema import leases
from openalice_scheduler.times import format_us


@dataclass(slots=True)
class LeaseRecord:
    """One row of the `leases` table, field for column (checked below)."""

    lease_id: str
    provider: str
    kind: str
    gpu: str
    state: str
    endpoint: str
    provider_token: str
    owner_id: str | None
    correlation_id: str | None
    region: str | None
    resource: str | None
    ttl_seconds: int
    created_at: int
    expires_at: int
    released_at: int | None
    release_reason: str | None
    release_attempts: int
    next_attempt_at: int | None
    last_error: str | None
    updated_at: int
    replica_id: str | None = None
    revision: int = 0
    # The engine of a local-docker fleet holding the worker (DOCKER_HOSTS), else None.
    host: str | None = None
    # A warm-pool worker's address for its hand-off (docs/concepts/pools.md#warm-pools), else None.
    probe_url: str | None = None
    # The lease's fencing token (docs/concepts/worker-self.md#what-a-worker-knows-of-its-lease).
    fence: int | None = None
    # What it costs (docs/concepts/money.md#prices-and-caps): the GPU type it got, USD per hour
    # (None: unknown), when it became active, and once ended its cost.
    gpu_type: str | None = None
    price_per_hour: float | None = None
    granted_at: int | None = None
    cost: float | None = None
    # Its caller's priority class; while preempted, when its worker goes and for whom.
    priority_class: str = "default"
    preempt_at: int | None = None
    preempted_by: str | None = None
    # Where the scheduler itself reaches the worker (a preemption's notice).
    worker_url: str | None = None
    # Why its worker stopped after its hand-out, and its exit code (models.LostCause).
    lost_cause: str | None = None
    exit_code: int | None = None
    # When a caller's request made it a lease; None: a pool worker never leased.
    requested_at: int | None = None
    # When it began as a warm-pool worker, and when it was ready; None: never one.
    pooled_at: int | None = None
    pool_ready_at: int | None = None

    def wire(self) -> dict[str, Any]:
        """The lease as callers see it (`models.Lease`)."""
        return wire_of([getattr(self, name) for name in WIRE_FIELDS])


COLUMNS = [c.name for c in leases.columns]
assert [f.name for f in fields(LeaseRecord)] == COLUMNS, "LeaseRecord fields != leases columns"


def record_of(row: Sequence[Any]) -> LeaseRecord:
    """A record from a row of `select(leases)` / `returning(*leases.c)` (column order)."""
    return LeaseRecord(*row)


# The wire shape is models.Lease: its fields, in its order, are columns of `leases`.
WIRE_FIELDS = tuple(Lease.model_fields)
assert set(WIRE_FIELDS) <= set(COLUMNS), "a Lease field is not a column of leases"
WIRE_COLUMNS = tuple(leases.c[name] for name in WIRE_FIELDS)
_TIMES = tuple(
    place
    for place, name in enumerate(WIRE_FIELDS)
    if name in ("created_at", "expires_at", "released_at", "granted_at", "preempt_at")
)


def wire_of(values: Sequence[Any]) -> dict[str, Any]:
    """The `Lease` of one row of WIRE_COLUMNS: the stored values, times in RFC 3339."""
    shown = list(values)
    for place in _TIMES:
        if shown[place] is not None:
            shown[place] = format_us(shown[place])
    return dict(zip(WIRE_FIELDS, shown, strict=True))


# How starlette's JSONResponse encodes, so a listing and a single lease read alike.
encode_json: Callable[[Any], str] = json.JSONEncoder(
    ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
).encode


@dataclass(frozen=True, slots=True)
class Move:
    """A change of a lease's state, as the core defines it (lifecycle/states.py): from
    any of `sources` (none: a new row) to `target`. The store applies it as a guarded
    update (`UPDATE … WHERE state IN <sources>`)."""

    name: str
    sources: tuple[LeaseState, ...]
    target: LeaseState


@dataclass(frozen=True, slots=True)
class StateSets:
    """The sets of states the store's reads and counts select leases by, as the core
    defines them (lifecycle/states.py: its one instance, STATE_SETS); the store names no
    state of its own. Given when the store is opened, so its statements are built once."""

    # A worker exists or is being made: it counts against its provider's cap and holds
    # its device; reconciliation and the guards watch it.
    holds_capacity: tuple[LeaseState, ...]
    # Answers an idempotent replay of its request (owner_id, correlation_id).
    answered: tuple[LeaseState, ...]
    # Counts against its owner's quota.
    held: tuple[LeaseState, ...]
    # Its owner pays for it now.
    paid: tuple[LeaseState, ...]
    # A warm pool's workers; those of them ready to be claimed.
    pooled: tuple[LeaseState, ...]
    idle: tuple[LeaseState, ...]
    # Over: what the purge deletes once past retention.
    ended: tuple[LeaseState, ...]
    # What the sweeper waits for (LeaseStore.next_due): an expiry (`expires_at`), a
    # release attempt (`next_attempt_at`), the end of a preemption's grace (`preempt_at`).
    expiring: tuple[LeaseState, ...]
    retrying: tuple[LeaseState, ...]
    in_grace: tuple[LeaseState, ...]


@dataclass(slots=True)
class NewLease:
    """A lease about to be reserved: what the request fixed."""

    lease_id: str
    kind: str
    gpu: str
    owner_id: str | None
    correlation_id: str | None
    region: str | None
    ttl_seconds: int
    created_at: int
    expires_at: int
    priority_class: str = "default"
    # When the caller asked (µs); None: not a caller's request (a pool worker's row).
    requested_at: int | None = None
    # When it begins as a warm-pool worker (µs); None: a caller's lease.
    pooled_at: int | None = None


@dataclass(frozen=True, slots=True)
class Terms:
    """What a reservation on one provider must respect, checked in its transaction."""

    now: int
    # The provider's cap on live workers (0: none).
    max_live: int = 0
    # The pool of which the lease takes one exclusively (GPU devices), or None.
    resources: Sequence[str] | None = None
    # Words for that pool in the refusal ("all 2 GPU devices are leased").
    resource_label: str = "GPU devices"
    # Live leases an owner may hold (0: no cap).
    owner_quota: int = 0
    # Instead of `resources`: picks the lease's resource and host from the resources the
    # provider's other live leases hold, or raises AtCapacity (a fleet's placement).
    place: Callable[[Set[str]], Placement] | None = None
    # The worker's price, USD per hour (None: unknown), recorded with the lease and
    # checked against the owner's `budget`; a placement's own price replaces it.
    price_per_hour: float | None = None
    budget: Budget | None = None


@dataclass(frozen=True, slots=True)
class Budget:
    """An owner's caps in money (budgets.py); 0: none. `hour_from` and `day_from` name
    the setting each cap comes from, for a refusal."""

    per_hour: float = 0.0
    per_day: float = 0.0
    hour_from: str = "MAX_COST_PER_HOUR_PER_OWNER"
    day_from: str = "MAX_SPEND_PER_DAY_PER_OWNER"


class OverQuota(AtCapacity):
    """The owner already holds MAX_LEASES_PER_OWNER live leases."""


class Behind(AtCapacity):
    """The capacity is there, but a caller ahead in line (priority, then arrival) waits
    for it: this one waits too."""


class OverBudget(Exception):
    """A lease at `price` would break one of the owner's caps in money: `cap` names it
    (its setting), `limit` is its value and `figure` the owner's own (USD per hour held,
    or spent over the last 24 h)."""

    def __init__(
        self, message: str, *, cap: str, limit: float, figure: float, price: float
    ) -> None:
        super().__init__(message)
        self.message = message
        self.cap, self.limit, self.figure, self.price = cap, limit, figure, price


class DuplicateRequest(Exception):
    """A live lease already answers this (owner_id, correlation_id)."""

    def __init__(self, lease_id: str) -> None:
        super().__init__(lease_id)
        self.lease_id = lease_id
