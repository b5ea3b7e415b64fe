"""The core's reservations run on a store as the lease path runs them (lifecycle/
admission.py composes each transaction, lifecycle/states.py names each move), for the
tests of the store itself: what they check is that the store applies them exactly."""

from __future__ import annotations

from openalice_scheduler.lifecycle import admission, states
from openalice_scheduler.lifecycle.admission import Assign
from openalice_scheduler.store import LeaseRecord, LeaseStore, NewLease, Terms
from openalice_scheduler.store.pool import PoolStore
from openalice_scheduler.store.records import Budget


async def reserve_lease(
    store: LeaseStore, lease: NewLease, provider: str, terms: Terms, *, moving: bool = False
) -> LeaseRecord:
    """A cold lease's reservation (`provisioning`), moved from a failed provider when
    `moving`."""
    move = states.MOVE_ON if moving else states.RESERVE
    return await store.reserve(lease, admission.reserve(lease, provider, terms, move))


async def reserve(
    store: LeaseStore, lease: NewLease, provider: str, terms: Terms, *, moving: bool = False
) -> str | None:
    """`reserve_lease`, answering the resource taken."""
    return (await reserve_lease(store, lease, provider, terms, moving=moving)).resource


async def reserve_active(
    store: LeaseStore,
    lease: NewLease,
    provider: str,
    terms: Terms,
    assign: Assign,
    *,
    moving: bool = False,
) -> LeaseRecord:
    """A lease on a worker that already runs: reserved and `active` at once."""
    move = states.ASSIGN_MOVED if moving else states.ASSIGN
    return await store.reserve(lease, admission.reserve(lease, provider, terms, move, assign))


async def reserve_warm(
    store: LeaseStore, lease: NewLease, provider: str, terms: Terms, target: int
) -> LeaseRecord | None:
    """A pool worker's reservation (`warming`); None when its pool is full. Nobody
    waits in line here (the line's rule has tests of its own)."""
    first = admission.FirstInLine(alive_since=terms.now, now=terms.now)
    return await store.reserve(
        lease, admission.reserve_warm(lease, provider, terms, target, states.WARM, first)
    )


async def claim(
    pool: PoolStore, lease: NewLease, quota: int, budget: Budget | None = None
) -> LeaseRecord | None:
    """The oldest idle pool worker claimed for the request `lease` describes."""
    return await pool.claim(lease, admission.claim_idle(lease, quota, budget, states.CLAIM))
