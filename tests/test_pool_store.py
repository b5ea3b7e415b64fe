"""The warm pool's transactions (store/pool.py), on SQLite and PostgreSQL: a pool is never
filled past its target however many fill it at once, an idle worker is claimed by one
request only, claims keep the owner's quota and idempotency, and pool workers count
against a provider's cap and devices like any lease but not against quotas."""

from __future__ import annotations

import asyncio

import pytest

from openalice_scheduler.lifecycle import states
from openalice_scheduler.models import LeaseState, ReleaseReason
from openalice_scheduler.store import (
    AtCapacity,
    DuplicateRequest,
    LeaseStore,
    NewLease,
    OverQuota,
    Terms,
)
from openalice_scheduler.store.pool import PoolStore
from tests import storeops
from tests.harness import new_lease_at

NOW = 1_800_000_000_000_000


def lease(
    owner: str | None = None,
    correlation: str | None = None,
    kind: str = "renderer",
    gpu: str = "none",
) -> NewLease:
    return new_lease_at(NOW, kind=kind, gpu=gpu, owner_id=owner, correlation_id=correlation)


async def warm(pool: PoolStore, n: int, **kw: str) -> list[str]:
    """`n` idle pool workers on provider p (kind/gpu from `kw`), their lease ids."""
    ids = []
    for i in range(n):
        reserved = await storeops.reserve_warm(
            pool.store, lease(**kw), "p", Terms(now=NOW), target=n
        )
        assert reserved is not None and reserved.state == LeaseState.warming
        ready = await pool.ready(
            reserved.lease_id,
            states.READY,
            endpoint=f"http://w{i}:8080",
            provider_token=f"c{i}",
            probe_url=f"http://10.0.0.{i}:8080",
            now=NOW + i,
        )
        assert ready is not None and ready.state == LeaseState.idle
        ids.append(ready.lease_id)
    return ids


async def test_a_pool_is_filled_to_its_target_and_no_further(store: LeaseStore) -> None:
    pool = PoolStore(store)
    got = await asyncio.gather(
        *(
            storeops.reserve_warm(pool.store, lease(), "p", Terms(now=NOW), target=3)
            for _ in range(10)
        )
    )
    assert sum(r is not None for r in got) == 3
    # Another kind's pool is its own.
    assert (
        await storeops.reserve_warm(pool.store, lease(kind="anim"), "p", Terms(now=NOW), target=1)
        is not None
    )
    counts = {(c.kind, c.state): c.count for c in await pool.counts()}
    assert counts == {("renderer", "warming"): 3, ("anim", "warming"): 1}


async def test_pool_workers_count_against_the_cap_and_devices(store: LeaseStore) -> None:
    pool = PoolStore(store)
    await warm(pool, 2)
    with pytest.raises(AtCapacity):
        await storeops.reserve(store, lease(), "p", Terms(now=NOW, max_live=2))
    # A GPU device an idle worker holds is not given to a cold lease.
    gpu = await storeops.reserve_warm(
        store, lease(gpu="entry"), "p", Terms(now=NOW, resources=["0"]), 1
    )
    assert gpu is not None and gpu.resource == "0"
    with pytest.raises(AtCapacity, match="GPU devices"):
        await storeops.reserve(store, lease(gpu="entry"), "p", Terms(now=NOW, resources=["0"]))
    # ... until it is recycled (once idle): then the device is free again.
    await pool.ready(
        gpu.lease_id,
        states.READY,
        endpoint="http://g:8080",
        provider_token="g",
        probe_url=None,
        now=NOW,
    )
    assert (await pool.room_on("p", "entry"))[0] == gpu.lease_id
    recycled = await pool.recycle(gpu.lease_id, states.RECYCLE, now=NOW)
    assert recycled is not None and recycled.release_reason == ReleaseReason.recycled
    await store.finish_release(gpu.lease_id, states.FINISH, now=NOW)
    assert (
        await storeops.reserve(store, lease(gpu="entry"), "p", Terms(now=NOW, resources=["0"]))
        == "0"
    )


async def test_an_idle_worker_is_claimed_once_oldest_first(store: LeaseStore) -> None:
    pool = PoolStore(store)
    ids = await warm(pool, 3)
    claims = await asyncio.gather(
        *(storeops.claim(pool, lease(owner=f"o{i}"), quota=0) for i in range(8))
    )
    won = [c for c in claims if c is not None]
    assert sorted(c.lease_id for c in won) == sorted(ids)  # each exactly once
    for claimed in won:
        assert claimed.state == LeaseState.provisioning
        assert claimed.owner_id is not None and claimed.expires_at == NOW + 60_000_000
        assert claimed.probe_url is not None and claimed.endpoint.startswith("http://w")
    assert await storeops.claim(pool, lease(), quota=0) is None

    # Oldest idle first: the first made is the first claimed.
    more = await warm(pool, 2, kind="anim")
    first = await storeops.claim(pool, lease(kind="anim"), quota=0)
    assert first is not None and first.lease_id == more[0]


async def test_a_claim_keeps_the_quota_and_idempotency(store: LeaseStore) -> None:
    pool = PoolStore(store)
    await warm(pool, 3)
    # Idle workers are no one's: an owner with a quota of 1 can still take one.
    claimed = await storeops.claim(pool, lease(owner="alice", correlation="job-1"), quota=1)
    assert claimed is not None
    await store.activate(
        claimed.lease_id,
        states.ACTIVATE,
        endpoint=claimed.endpoint,
        provider_token=claimed.provider_token,
        now=NOW,
    )
    with pytest.raises(OverQuota):
        await storeops.claim(pool, lease(owner="alice"), quota=1)
    with pytest.raises(DuplicateRequest) as twin:
        await storeops.claim(pool, lease(owner="alice", correlation="job-1"), quota=0)
    assert twin.value.lease_id == claimed.lease_id
    # Refused claims left the idle workers idle.
    assert sum(c.count for c in await pool.counts() if c.state == "idle") == 2


async def test_reconciliation_states_cover_pool_rows(store: LeaseStore) -> None:
    pool = PoolStore(store)
    reserved = await storeops.reserve_warm(pool.store, lease(), "p", Terms(now=NOW), target=2)
    assert reserved is not None
    # A warming row whose provision is abandoned ends failed, like a provisioning one.
    failed = await store.fail(reserved.lease_id, states.FAIL, error="scheduler stopped", now=NOW)
    assert failed is not None and failed.state == LeaseState.failed
    [idle] = await warm(pool, 1)
    # An idle worker that vanished is released `lost`; it is no longer claimable.
    lost = await store.mark_lost(idle, states.LOSE, now=NOW)
    assert lost is not None and lost.release_reason == ReleaseReason.lost
    assert await storeops.claim(pool, lease(), quota=0) is None
    assert await pool.recycle(idle, states.RECYCLE, now=NOW) is None
