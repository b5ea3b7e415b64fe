"""The reserving transaction of a lease (cold, static or a warm claim): the owner's
checks under the owner's lock (a twin request, the quota, the caps in money), then the
provider's under the provider's (its cap, one free exclusive resource), then the row.
Run by LeaseStore and PoolStore through `Backend.write`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Connection

from openalice_scheduler.models import LeaseState
from openalice_scheduler.store.backend import Backend
from openalice_scheduler.store.records import (
    AtCapacity,
    DuplicateRequest,
    LeaseRecord,
    NewLease,
    OverQuota,
    Terms,
    record_of,
)
from openalice_scheduler.store.spending import check_budget
from openalice_scheduler.store.statements import (
    COUNT_LIVE,
    HELD_BY_OWNER,
    INSERT,
    TAKEN,
    TWIN,
    transition_tx,
)


def reserve_tx(
    conn: Connection,
    backend: Backend,
    replica_id: str,
    lease: NewLease,
    provider: str,
    terms: Terms,
    assign: Callable[[str | None], tuple[str, str]] | None,
    moving: bool,
    state: LeaseState = LeaseState.provisioning,
) -> LeaseRecord:
    # Serialised per owner (quota, idempotency), then per provider (cap, devices).
    owner_checks(conn, backend, lease, terms.owner_quota)
    backend.lock(conn, f"provider:{provider}")
    mine = {"b_id": lease.lease_id, "b_provider": provider}
    if terms.max_live:
        count = conn.execute(COUNT_LIVE, mine).scalar_one()
        if count >= terms.max_live:
            raise AtCapacity(f"at capacity ({count}/{terms.max_live} live workers)")
    resource = host = None
    price = terms.price_per_hour
    if terms.place is not None:
        placed = terms.place(set(conn.execute(TAKEN, mine).scalars()))
        resource, host = placed.resource, placed.host
        price = price if placed.price is None else placed.price
    elif terms.resources is not None:
        taken = set(conn.execute(TAKEN, mine).scalars())
        resource = next((r for r in terms.resources if r not in taken), None)
        if resource is None:
            raise AtCapacity(f"all {len(terms.resources)} {terms.resource_label} are leased")
    if terms.budget is not None:  # still under the owner's lock
        check_budget(conn, lease, price, terms.budget, terms.now)
    values: dict[str, Any] = {
        "provider": provider,
        "state": state.value,
        "resource": resource,
        "host": host,
        "updated_at": terms.now,
        "replica_id": replica_id,
        "endpoint": "",
        "provider_token": "",
        "price_per_hour": price,
        "gpu_type": None,
        "granted_at": None,
    }
    if assign is not None:
        values["state"] = LeaseState.active.value
        values["endpoint"], values["provider_token"] = assign(resource)
        values["granted_at"] = terms.now
    if moving:  # from a provider that failed to provision it: its fence stays
        moved = transition_tx(conn, lease.lease_id, (LeaseState.provisioning,), values)
        if moved is not None:
            return moved
    row = conn.execute(
        INSERT,
        {
            "lease_id": lease.lease_id,
            "kind": lease.kind,
            "gpu": lease.gpu,
            "owner_id": lease.owner_id,
            "correlation_id": lease.correlation_id,
            "region": lease.region,
            "ttl_seconds": lease.ttl_seconds,
            "created_at": lease.created_at,
            "expires_at": lease.expires_at,
            "release_attempts": 0,
            "fence": backend.next_fence(conn),
            **values,
        },
    ).one()
    return record_of(row)


def owner_checks(conn: Connection, backend: Backend, lease: NewLease, quota: int) -> None:
    """In a lease's reserving transaction (cold, or a warm worker's claim): takes the
    owner's lock, then refuses a second lease for the same request (DuplicateRequest)
    and an owner over `quota` (OverQuota)."""
    if not lease.owner_id:
        return
    backend.lock(conn, f"owner:{lease.owner_id}")
    mine = {"b_id": lease.lease_id, "b_owner": lease.owner_id}
    if lease.correlation_id:
        twin = conn.execute(TWIN, {**mine, "b_corr": lease.correlation_id}).scalar()
        if twin is not None:
            raise DuplicateRequest(twin)
    if quota:
        held = conn.execute(HELD_BY_OWNER, mine).scalar_one()
        if held >= quota:
            raise OverQuota(
                f"owner {lease.owner_id!r} holds {held} leases; MAX_LEASES_PER_OWNER is {quota}"
            )
