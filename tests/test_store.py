"""The state store on its own: migrations, guarded transitions, atomic reservations."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sqlite3
import sys
import time
import uuid
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import update
from sqlalchemy.engine import Connection

from openalice_scheduler.errors import StoreUnavailable
from openalice_scheduler.models import ReleaseReason
from openalice_scheduler.store import AtCapacity, LeaseStore, NewLease, database, schema, syncer
from openalice_scheduler.store.schema import metadata
from tests.harness import database_url

NOW = 1_800_000_000_000_000


def new_lease(expires_in_s: int = 60) -> NewLease:
    return NewLease(
        lease_id=str(uuid.uuid4()), kind="renderer", gpu="none", owner_id=None,
        correlation_id=None, region=None, ttl_seconds=expires_in_s,
        created_at=NOW, expires_at=NOW + expires_in_s * 1_000_000,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    with database_url(request.param, tmp_path) as url:
        s = LeaseStore(url)
        await s.migrate()
        yield s
        await s.close()


async def test_migrations_build_exactly_the_schema_the_code_uses(store: LeaseStore) -> None:
    diff = await store.db.read(
        lambda conn: compare_metadata(MigrationContext.configure(conn), metadata)
    )
    assert diff == []
    await store.migrate()  # idempotent


async def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    store = LeaseStore(f"sqlite:///{tmp_path / 'store.db'}")
    await store.migrate()
    await store.close()
    mode = sqlite3.connect(tmp_path / "store.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


async def test_reservations_never_exceed_the_cap(store: LeaseStore) -> None:
    results = await asyncio.gather(
        *(store.reserve(new_lease(), "p", max_live=10, resources=None, now=NOW)
          for _ in range(50)),
        return_exceptions=True,
    )
    assert sum(1 for r in results if not isinstance(r, Exception)) == 10
    assert all(isinstance(r, AtCapacity) for r in results if isinstance(r, Exception))
    assert (await store.count_by_state()) == {"provisioning": 10}


async def test_exclusive_resources_are_never_shared(store: LeaseStore) -> None:
    leases = [new_lease() for _ in range(5)]
    results = await asyncio.gather(
        *(store.reserve(lease, "gpu", max_live=0, resources=["0", "1"], now=NOW)
          for lease in leases),
        return_exceptions=True,
    )
    taken = [r for r in results if isinstance(r, str)]
    assert sorted(taken) == ["0", "1"]
    # Releasing one frees its device for the next lease.
    holder = leases[results.index("0")]
    await store.activate(holder.lease_id, endpoint="e", provider_token="t", now=NOW)
    await store.claim_release(holder.lease_id, ReleaseReason.explicit, now=NOW)
    await store.finish_release(holder.lease_id, now=NOW)
    assert await store.reserve(new_lease(), "gpu", max_live=0, resources=["0", "1"],
                               now=NOW) == "0"


async def test_an_expired_lease_is_claimed_exactly_once(store: LeaseStore) -> None:
    lease = new_lease(expires_in_s=1)
    await store.reserve(lease, "p", max_live=0, resources=None, now=NOW)
    await store.activate(lease.lease_id, endpoint="e", provider_token="t", now=NOW)
    later = NOW + 2_000_000
    claims = await asyncio.gather(*(store.claim_expired(now=later) for _ in range(5)))
    assert sum(len(c) for c in claims) == 1
    claimed = [c for c in claims if c][0][0]
    assert claimed.state == "releasing" and claimed.release_reason == "expired"
    # Until the claim lapses, nobody retries it.
    assert await store.claim_retries(now=later + 1) == []


async def test_failed_release_is_kept_and_retried(store: LeaseStore) -> None:
    lease = new_lease()
    await store.reserve(lease, "p", max_live=0, resources=None, now=NOW)
    await store.activate(lease.lease_id, endpoint="e", provider_token="t", now=NOW)
    await store.claim_release(lease.lease_id, ReleaseReason.explicit, now=NOW)
    failed = await store.release_attempt_failed(lease.lease_id, error="engine down",
                                                retry_at=NOW + 5, now=NOW)
    assert failed is not None and failed.release_attempts == 1
    assert await store.next_due() == NOW + 5
    retried = await store.claim_retries(now=NOW + 5)
    assert [r.lease_id for r in retried] == [lease.lease_id]
    done = await store.finish_release(lease.lease_id, now=NOW + 6)
    assert done is not None and done.state == "released" and done.release_reason == "explicit"


async def test_transitions_are_guarded(store: LeaseStore) -> None:
    lease = new_lease()
    await store.reserve(lease, "p", max_live=0, resources=None, now=NOW)
    assert await store.claim_release(lease.lease_id, ReleaseReason.explicit, now=NOW) is None
    assert await store.mark_lost(lease.lease_id, now=NOW) is None
    failed = await store.fail(lease.lease_id, error="boom", now=NOW)
    assert failed is not None and failed.state == "failed"
    # A provision that finishes after its lease was resolved cannot revive it.
    assert await store.activate(lease.lease_id, endpoint="e", provider_token="t",
                                now=NOW) is None


async def test_times_round_trip_exactly(store: LeaseStore) -> None:
    lease = new_lease()
    await store.reserve(lease, "p", max_live=0, resources=None, now=NOW)
    record = await store.activate(lease.lease_id, endpoint="e", provider_token="t", now=NOW)
    assert record is not None
    wire = record.wire()
    assert wire["created_at"] == "2027-01-15T08:00:00.000000Z"
    assert wire["expires_at"] == "2027-01-15T08:01:00.000000Z"


async def test_cached_listing_always_shows_the_current_leases(store: LeaseStore) -> None:
    import json

    async def active(lease: NewLease) -> None:
        await store.reserve(lease, "p", max_live=0, resources=None, now=NOW)
        await store.activate(lease.lease_id, endpoint="e", provider_token="t", now=NOW)

    first, second = new_lease(), new_lease()
    await active(first)
    listed = json.loads(await store.list_wire_json())
    assert listed == await store.list_wire() and [x["lease_id"] for x in listed] == [
        first.lease_id]
    await active(second)
    assert json.loads(await store.list_wire_json()) == await store.list_wire()
    assert len(await store.list_wire()) == 2
    await store.claim_release(first.lease_id, ReleaseReason.explicit, now=NOW + 1)
    after = json.loads(await store.list_wire_json())
    assert [x["lease_id"] for x in after] == [second.lease_id]
    assert json.loads(await store.list_wire_json()) == after  # served again from cache


async def test_static_lease_is_reserved_active_and_released_in_one_write_each(
    store: LeaseStore,
) -> None:
    owned = replace(new_lease(), owner_id="alice")
    record = await store.reserve_active(
        owned, "static", assign=lambda r: (f"http://{r}", f"token-{r}"), max_live=0,
        resources=("a:1", "b:1"), now=NOW, first_try=True,
    )
    assert (record.state, record.endpoint, record.provider_token, record.resource) == (
        "active", "http://a:1", "token-a:1", "a:1")
    assert (await store.get(owned.lease_id)) == record

    at_once = partial(store.release_at_once, owned.lease_id, providers=("static",),
                      reason=ReleaseReason.explicit, now=NOW + 1)
    # Someone else's lease, or one on a provider with workers to destroy: not released.
    assert await at_once(owner=None) is None
    assert await at_once(owner="bob") is None
    assert await store.release_at_once(owned.lease_id, owner="alice", providers=("other",),
                                       reason=ReleaseReason.explicit, now=NOW + 1) is None
    done = await at_once(owner="alice")
    assert done is not None and (done.state, done.release_reason, done.released_at) == (
        "released", "explicit", NOW + 1)
    assert await at_once(owner="alice") is None  # never twice
    # Its endpoint is free again.
    again = await store.reserve_active(
        new_lease(), "static", assign=lambda r: (r, r), max_live=0, resources=("a:1", "b:1"),
        now=NOW, first_try=True,
    )
    assert again.resource == "a:1"


async def test_a_static_lease_is_released_as_it_is_now_not_as_it_was_acquired(
    store: LeaseStore,
) -> None:
    """On SQLite, release_at_once does not read again a lease that reserve_active wrote
    and that has not changed since. One renewed (or otherwise written) meanwhile is
    read: either way the released lease returned is the stored one."""
    def acquire() -> Any:
        return store.reserve_active(
            new_lease(), "static", assign=lambda r: (r, r), max_live=0,
            resources=("a:1", "b:1"), now=NOW, first_try=True,
        )

    plain, renewed = await acquire(), await acquire()
    assert (await store.renew(renewed.lease_id, expires_at=NOW + 999_000_000, now=NOW + 5)
            is not None)
    release = partial(store.release_at_once, owner=None, providers=("static",),
                      reason=ReleaseReason.explicit, now=NOW + 10)

    done = await release(plain.lease_id)
    assert done == replace(plain, state="released", released_at=NOW + 10,
                           updated_at=NOW + 10, release_reason="explicit")
    assert done == await store.get(plain.lease_id)
    done = await release(renewed.lease_id)
    assert done is not None and done.expires_at == NOW + 999_000_000
    assert done == await store.get(renewed.lease_id)
    assert await release(renewed.lease_id) is None  # never twice


async def test_free_resources_are_judged_by_the_file_not_by_what_the_process_remembers(
    tmp_path: Path,
) -> None:
    """On SQLite the lease path knows which resources are held without asking the
    database for every reservation. Whatever else changed the leases meanwhile is seen
    by the next reservation all the same: a lease written by another connection (an
    operator's tool), a release by another path than release_at_once."""
    path = tmp_path / "store.db"
    store = LeaseStore(f"sqlite:///{path}")
    await store.migrate()
    resources = ("a", "b", "c")

    def take() -> Any:
        return store.reserve_active(new_lease(), "static", assign=lambda r: (r, r),
                                    max_live=0, resources=resources, now=NOW, first_try=True)

    try:
        first = await take()
        assert first.resource == "a"
        assert await store.release_at_once(first.lease_id, owner=None, providers=("static",),
                                           reason=ReleaseReason.explicit, now=NOW + 1)
        second = await take()
        assert second.resource == "a"  # freed by release_at_once: free again at once

        # Another connection writes a live lease holding "b".
        columns = [c.name for c in schema.leases.columns]
        chosen = [{"lease_id": "?", "resource": "'b'"}.get(c, c) for c in columns]
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as tool:
            tool.execute(f"INSERT INTO leases ({', '.join(columns)}) "
                         f"SELECT {', '.join(chosen)} FROM leases WHERE lease_id = ?",
                         (str(uuid.uuid4()), second.lease_id))
        third = await take()
        assert third.resource == "c"

        # "a" freed by claim_release + finish_release: the next lease gets it.
        await store.claim_release(second.lease_id, ReleaseReason.explicit, now=NOW + 2)
        await store.finish_release(second.lease_id, now=NOW + 2)
        assert (await take()).resource == "a"
        with pytest.raises(AtCapacity):
            await take()
    finally:
        await store.close()


async def test_a_failed_write_undoes_only_its_own_work(store: LeaseStore) -> None:
    """Concurrent writes share a transaction (SQLite: group commit). A write that fails
    after writing takes back only what it wrote; one that fails before writing costs the
    others nothing; the rest commit."""
    leases = [new_lease() for _ in range(6)]
    for lease in leases:
        await store.reserve(lease, "p", max_live=0, resources=None, now=NOW)

    def renew_then_fail(conn: Connection, lease_id: str) -> None:
        conn.execute(update(schema.leases).where(schema.leases.c.lease_id == lease_id)
                     .values(expires_at=NOW + 999))
        raise RuntimeError("after writing")

    def refuse(_conn: Connection) -> None:
        raise LookupError("before writing")

    outcomes = await asyncio.gather(
        store.activate(leases[0].lease_id, endpoint="e0", provider_token="t", now=NOW),
        store.db.write(renew_then_fail, leases[1].lease_id),
        store.activate(leases[2].lease_id, endpoint="e2", provider_token="t", now=NOW),
        store.db.write(refuse),
        store.activate(leases[3].lease_id, endpoint="e3", provider_token="t", now=NOW),
        return_exceptions=True,
    )
    assert isinstance(outcomes[1], RuntimeError) and isinstance(outcomes[3], LookupError)
    for place in (0, 2, 4):
        assert outcomes[place] is not None and outcomes[place].state == "active"
    stored = {lease.lease_id: await store.get(lease.lease_id) for lease in leases}
    assert [stored[lease.lease_id].state for lease in leases] == [
        "active", "provisioning", "active", "active", "provisioning", "provisioning"]
    assert stored[leases[1].lease_id].expires_at == leases[1].expires_at


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


async def test_sqlite_writes_are_synced_by_a_helper_started_again_when_it_dies(
    tmp_path: Path,
) -> None:
    """With SQLITE_SYNCHRONOUS=full the writes are fsynced by a helper process (a test
    below shows that its failure fails them). A helper killed between two writes costs
    nothing: the next write starts another and succeeds. Closing the store ends it."""
    store = LeaseStore(f"sqlite:///{tmp_path / 'store.db'}")
    await store.migrate()
    helper = store.db._impl._syncer  # type: ignore[union-attr]
    assert helper is not None
    try:
        await store.reserve(new_lease(), "p", max_live=0, resources=None, now=NOW)
        first = helper.pid
        assert first is not None and _alive(first)
        assert "syncer.py" in Path(f"/proc/{first}/cmdline").read_text()

        os.kill(first, signal.SIGKILL)
        lease = new_lease()
        # Twice: the first may find the pipe already closed, or hear nothing back.
        for _ in range(2):
            await store.reserve(new_lease(), "p", max_live=0, resources=None, now=NOW)
        await store.reserve(lease, "p", max_live=0, resources=None, now=NOW)
        second = helper.pid
        assert second is not None and second != first and _alive(second)
        assert (await store.get(lease.lease_id)) is not None
    finally:
        await store.close()
    assert not _alive(second)


def test_a_store_used_from_a_second_event_loop_still_syncs(tmp_path: Path) -> None:
    """The helper's answers are read on the event loop of the write that asks: a store
    used from a second loop (the first one closed) is not left waiting."""
    store = LeaseStore(f"sqlite:///{tmp_path / 'store.db'}")

    async def first() -> None:
        await store.migrate()
        await store.reserve(new_lease(), "p", max_live=0, resources=None, now=NOW)

    async def second() -> None:
        try:
            lease = new_lease()
            await asyncio.wait_for(
                store.reserve(lease, "p", max_live=0, resources=None, now=NOW), 30)
            assert (await store.get(lease.lease_id)) is not None
        finally:
            await store.close()

    asyncio.run(first())
    asyncio.run(second())


async def test_a_failed_fsync_fails_the_write_with_store_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper whose fsync fails (it answers `e`): the caller is told the store is
    unavailable (503), not that its write is safe."""
    store = LeaseStore(f"sqlite:///{tmp_path / 'store.db'}")
    await store.migrate()
    failing = [sys.executable, "-c", "import os\nwhile os.read(0, 1): os.write(1, b'e')"]
    monkeypatch.setattr(database._Syncer, "command", lambda _self: failing)
    store.db._impl._syncer.close()  # type: ignore[union-attr]  # the next write starts one
    try:
        with pytest.raises(StoreUnavailable):
            await store.reserve(new_lease(), "p", max_live=0, resources=None, now=NOW)
    finally:
        await store.close()


async def test_the_helper_checkpoints_the_wal_into_the_database_file(tmp_path: Path) -> None:
    """The writer does not checkpoint (it would fsync on the event loop): the helper
    does, every CHECKPOINT_EVERY syncs, so the WAL does not grow without end and the
    database file itself receives the leases."""
    path = tmp_path / "store.db"
    store = LeaseStore(f"sqlite:///{path}")
    await store.migrate()

    def in_database_file() -> int:
        copy = tmp_path / "copy.db"  # the database file alone, without its WAL
        shutil.copyfile(path, copy)
        try:
            with contextlib.closing(sqlite3.connect(copy)) as conn:
                return int(conn.execute("SELECT count(*) FROM leases").fetchone()[0])
        except sqlite3.Error:  # copied mid-checkpoint
            return -1
        finally:
            for name in ("copy.db", "copy.db-wal", "copy.db-shm"):
                (tmp_path / name).unlink(missing_ok=True)

    try:
        for _ in range(syncer.CHECKPOINT_EVERY + 8):  # one batch, one sync each
            await store.reserve(new_lease(), "p", max_live=0, resources=None, now=NOW)
        deadline = time.monotonic() + 30
        while in_database_file() < syncer.CHECKPOINT_EVERY // 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert in_database_file() >= syncer.CHECKPOINT_EVERY // 2
    finally:
        await store.close()


async def test_a_write_lock_held_by_another_process_is_waited_for_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding the SQLite file's write lock: writes wait without stopping
    the event loop; reads go on; past the timeout the write is StoreUnavailable (503),
    and once the lock is let go the same write succeeds: nothing was half done."""
    monkeypatch.setattr(database, "_LOCKED_TIMEOUT_S", 0.5)
    store = LeaseStore(f"sqlite:///{tmp_path / 'store.db'}")
    await store.migrate()
    lease = new_lease()
    tool = sqlite3.connect(tmp_path / "store.db", isolation_level=None)
    tool.execute("BEGIN IMMEDIATE")
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        with pytest.raises(StoreUnavailable, match="write lock"):
            await store.reserve(lease, "p", max_live=0, resources=None, now=NOW)
        assert await store.get(lease.lease_id) is None  # reads answer meanwhile
    finally:
        ticker.cancel()
        tool.execute("ROLLBACK")
        tool.close()
    # The loop ran on while the write waited (a wait inside SQLite would have stopped
    # it for the whole half second: no tick at all).
    assert ticks >= 10, ticks
    await store.reserve(lease, "p", max_live=0, resources=None, now=NOW)
    stored = await store.get(lease.lease_id)
    assert stored is not None and stored.state == "provisioning"
    await store.close()


async def test_a_write_behind_a_waiting_one_gives_up_from_its_own_arrival(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that arrives while another is already waiting for another process's lock
    gets its 503 one timeout after its own arrival, not a timeout after the one ahead of
    it gave up (which made it wait up to twice as long)."""
    monkeypatch.setattr(database, "_LOCKED_TIMEOUT_S", 2.0)
    store = LeaseStore(f"sqlite:///{tmp_path / 'store.db'}")
    await store.migrate()
    first, second = new_lease(), new_lease()
    tool = sqlite3.connect(tmp_path / "store.db", isolation_level=None)
    tool.execute("BEGIN IMMEDIATE")
    try:
        waiting = asyncio.create_task(
            store.reserve(first, "p", max_live=0, resources=None, now=NOW))
        await asyncio.sleep(1.0)
        behind = asyncio.create_task(
            store.reserve(second, "p", max_live=0, resources=None, now=NOW))
        # Let go at 3.5 s: past the second write's own limit (3.0 s), before the limit it
        # had when its wait only began once the first gave up (2.0 + 2.0 s).
        await asyncio.sleep(2.5)
    finally:
        tool.execute("ROLLBACK")
        tool.close()
    for task in (waiting, behind):
        with pytest.raises(StoreUnavailable, match="write lock"):
            await task
    assert await store.get(first.lease_id) is None
    assert await store.get(second.lease_id) is None
    await store.close()
