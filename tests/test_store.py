"""The state store on its own: migrations, guarded transitions, atomic reservations."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import update
from sqlalchemy.engine import Connection

from openalice_scheduler.errors import StoreUnavailable
from openalice_scheduler.lifecycle import states
from openalice_scheduler.lifecycle.states import STATE_SETS
from openalice_scheduler.models import LeaseState, ReleaseReason
from openalice_scheduler.store import (
    AtCapacity,
    LeaseStore,
    NewLease,
    Terms,
    open_store,
    schema,
    sqlite,
)
from openalice_scheduler.store.schema import metadata
from tests import storeops
from tests.harness import database_url, new_lease_at, wait_for
from tests.procs import children

NOW = 1_800_000_000_000_000


def new_lease(expires_in_s: int = 60) -> NewLease:
    return new_lease_at(NOW, ttl_seconds=expires_in_s)


async def test_migrations_build_exactly_the_schema_the_code_uses(store: LeaseStore) -> None:
    diff = await store.backend.schema(
        lambda conn: compare_metadata(MigrationContext.configure(conn), metadata)
    )
    assert diff == []
    await store.migrate()  # idempotent


async def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}", states=STATE_SETS)
    await store.migrate()
    await store.close()
    mode = sqlite3.connect(tmp_path / "store.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


async def test_reservations_never_exceed_the_cap(store: LeaseStore) -> None:
    results = await asyncio.gather(
        *(
            storeops.reserve(store, new_lease(), "p", Terms(NOW, max_live=10, resources=None))
            for _ in range(50)
        ),
        return_exceptions=True,
    )
    assert sum(1 for r in results if not isinstance(r, Exception)) == 10
    assert all(isinstance(r, AtCapacity) for r in results if isinstance(r, Exception))
    assert (await store.count_by_state()) == {"provisioning": 10}


async def test_exclusive_resources_are_never_shared(store: LeaseStore) -> None:
    leases = [new_lease() for _ in range(5)]
    results = await asyncio.gather(
        *(
            storeops.reserve(store, lease, "gpu", Terms(NOW, max_live=0, resources=["0", "1"]))
            for lease in leases
        ),
        return_exceptions=True,
    )
    taken = [r for r in results if isinstance(r, str)]
    assert sorted(taken) == ["0", "1"]
    # Releasing one frees its device for the next lease.
    holder = leases[results.index("0")]
    await store.activate(
        holder.lease_id, states.ACTIVATE, endpoint="e", provider_token="t", now=NOW
    )
    await store.claim_release(holder.lease_id, ReleaseReason.explicit, states.RELEASE, now=NOW)
    await store.finish_release(holder.lease_id, states.FINISH, now=NOW)
    assert (
        await storeops.reserve(store, new_lease(), "gpu", Terms(NOW, resources=["0", "1"])) == "0"
    )


async def test_a_lease_moved_to_another_provider_gives_back_what_it_held(
    store: LeaseStore,
) -> None:
    """A provider failed to provision it: the same lease, reserved again elsewhere, is one
    row on the new provider, and the device it held on the old one is free."""
    lease = new_lease()
    assert await storeops.reserve(store, lease, "gpu", Terms(NOW, resources=["0"])) == "0"
    with pytest.raises(AtCapacity):
        await storeops.reserve(store, new_lease(), "gpu", Terms(NOW, resources=["0"]))
    await storeops.reserve(store, lease, "p", Terms(NOW, max_live=0, resources=None), moving=True)
    moved = await store.get(lease.lease_id)
    assert moved is not None and (moved.provider, moved.resource) == ("p", None)
    assert await storeops.reserve(store, new_lease(), "gpu", Terms(NOW, resources=["0"])) == "0"
    assert [r.lease_id for r in await store.live("p")] == [lease.lease_id]


async def test_resources_are_exclusive_across_stores_without_a_cap(
    tmp_path: Path,
) -> None:
    """Two stores on one PostgreSQL database (two replicas, two pools), no cap, 40
    reservations at once for 8 endpoints: each endpoint is taken exactly once."""
    with database_url("postgresql", tmp_path) as url:
        stores = [open_store(url, states=STATE_SETS), open_store(url, states=STATE_SETS)]
        for s in stores:
            await s.migrate()
        try:
            resources = [f"http://w{i}:8080" for i in range(8)]
            results = await asyncio.gather(
                *(
                    storeops.reserve(
                        stores[i % 2], new_lease(), "static", Terms(NOW, resources=resources)
                    )
                    for i in range(40)
                ),
                return_exceptions=True,
            )
            taken = [r for r in results if isinstance(r, str)]
            assert sorted(taken) == sorted(resources)
            assert all(isinstance(r, AtCapacity) for r in results if not isinstance(r, str))
            assert (await stores[1].count_by_state()) == {"provisioning": 8}
        finally:
            for s in stores:
                await s.close()


async def test_an_expired_lease_is_claimed_exactly_once(store: LeaseStore) -> None:
    lease = new_lease(expires_in_s=1)
    await storeops.reserve(store, lease, "p", Terms(NOW, max_live=0, resources=None))
    await store.activate(lease.lease_id, states.ACTIVATE, endpoint="e", provider_token="t", now=NOW)
    later = NOW + 2_000_000
    claims = await asyncio.gather(
        *(store.claim_expired(states.EXPIRE, now=later) for _ in range(5))
    )
    assert sum(len(c) for c in claims) == 1
    claimed = [c for c in claims if c][0][0]
    assert claimed.state == "releasing" and claimed.release_reason == "expired"
    # Until the claim lapses, nobody retries it.
    assert await store.claim_retries(states.RETRY, now=later + 1) == []


async def test_failed_release_is_kept_and_retried(store: LeaseStore) -> None:
    lease = new_lease()
    await storeops.reserve(store, lease, "p", Terms(NOW, max_live=0, resources=None))
    await store.activate(lease.lease_id, states.ACTIVATE, endpoint="e", provider_token="t", now=NOW)
    await store.claim_release(lease.lease_id, ReleaseReason.explicit, states.RELEASE, now=NOW)
    failed = await store.release_attempt_failed(
        lease.lease_id, states.ATTEMPT_FAILED, error="engine down", retry_at=NOW + 5, now=NOW
    )
    assert failed is not None and failed.release_attempts == 1
    assert await store.next_due() == NOW + 5
    retried = await store.claim_retries(states.RETRY, now=NOW + 5)
    assert [r.lease_id for r in retried] == [lease.lease_id]
    done = await store.finish_release(lease.lease_id, states.FINISH, now=NOW + 6)
    assert done is not None and done.state == "released" and done.release_reason == "explicit"


async def test_transitions_are_guarded(store: LeaseStore) -> None:
    lease = new_lease()
    await storeops.reserve(store, lease, "p", Terms(NOW, max_live=0, resources=None))
    assert (
        await store.claim_release(lease.lease_id, ReleaseReason.explicit, states.RELEASE, now=NOW)
        is None
    )
    assert await store.mark_lost(lease.lease_id, states.LOSE, now=NOW) is None
    failed = await store.fail(lease.lease_id, states.FAIL, error="boom", now=NOW)
    assert failed is not None and failed.state == "failed"
    # A provision that finishes after its lease was resolved cannot revive it.
    assert (
        await store.activate(
            lease.lease_id, states.ACTIVATE, endpoint="e", provider_token="t", now=NOW
        )
        is None
    )


async def test_times_round_trip_exactly(store: LeaseStore) -> None:
    lease = new_lease()
    await storeops.reserve(store, lease, "p", Terms(NOW, max_live=0, resources=None))
    record = await store.activate(
        lease.lease_id, states.ACTIVATE, endpoint="e", provider_token="t", now=NOW
    )
    assert record is not None
    wire = record.wire()
    assert wire["created_at"] == "2027-01-15T08:00:00.000000Z"
    assert wire["expires_at"] == "2027-01-15T08:01:00.000000Z"


async def test_a_listing_always_shows_the_leases_as_they_are_now(store: LeaseStore) -> None:
    """Listings reuse the encodings of unchanged rows: whatever changed a row (the
    store, or another connection writing behind its back, updated_at untouched), the
    next listing shows it as it is."""
    import json

    async def active(lease: NewLease) -> None:
        await storeops.reserve(store, lease, "p", Terms(NOW))
        await store.activate(
            lease.lease_id, states.ACTIVATE, endpoint="e", provider_token="t", now=NOW
        )

    def listed_ids(body: bytes) -> list[str]:
        return [x["lease_id"] for x in json.loads(body)]

    shown = (LeaseState.active,)

    assert await store.list_json(shown) == b"[]"
    first, second = new_lease(), replace(new_lease(), created_at=NOW + 1)
    await active(first)
    assert listed_ids(await store.list_json(shown)) == [first.lease_id]
    await active(second)
    assert listed_ids(await store.list_json(shown)) == [
        first.lease_id,
        second.lease_id,
    ]
    # Written behind the store's back, with the same updated_at: still seen.
    await store.backend.write(
        lambda conn: conn.execute(
            update(schema.leases)
            .where(schema.leases.c.lease_id == second.lease_id)
            .values(endpoint="http://moved:1")
        )
    )
    listed = json.loads(await store.list_json(shown))
    assert [x["endpoint"] for x in listed] == ["e", "http://moved:1"]
    assert listed[1] == (await store.get(second.lease_id)).wire()  # type: ignore[union-attr]
    await store.claim_release(first.lease_id, ReleaseReason.explicit, states.RELEASE, now=NOW + 1)
    assert listed_ids(await store.list_json(shown)) == [second.lease_id]
    await store.claim_release(second.lease_id, ReleaseReason.explicit, states.RELEASE, now=NOW + 1)
    assert await store.list_json(shown) == b"[]"


async def test_a_static_lease_is_active_at_once_and_released_in_the_claim(
    store: LeaseStore,
) -> None:
    owned = replace(new_lease(), owner_id="alice")
    terms = Terms(NOW, resources=("a:1", "b:1"), resource_label="static endpoints")
    record = await storeops.reserve_active(
        store, owned, "static", terms, lambda r: (f"http://{r}", f"token-{r}")
    )
    assert (record.state, record.endpoint, record.provider_token, record.resource) == (
        "active",
        "http://a:1",
        "token-a:1",
        "a:1",
    )
    assert (await store.get(owned.lease_id)) == record
    done = await store.claim_release(
        owned.lease_id,
        ReleaseReason.explicit,
        states.RELEASE,
        now=NOW + 1,
        at_once=(states.RELEASE_AT_ONCE, ("static",)),
    )
    assert done is not None and (done.state, done.release_reason, done.released_at) == (
        "released",
        "explicit",
        NOW + 1,
    )
    assert (
        await store.claim_release(
            owned.lease_id,
            ReleaseReason.explicit,
            states.RELEASE,
            now=NOW + 2,
            at_once=(states.RELEASE_AT_ONCE, ("static",)),
        )
        is None
    )  # never twice
    again = await storeops.reserve_active(store, new_lease(), "static", terms, lambda r: (r, r))
    assert again.resource == "a:1"  # its endpoint is free again


async def test_free_resources_are_judged_by_the_file_not_by_what_the_process_remembers(
    tmp_path: Path,
) -> None:
    """Which resources are held is read from the file at each reservation: a lease
    written by another connection (an operator's tool) is seen by the next one."""
    path = tmp_path / "store.db"
    store = open_store(f"sqlite:///{path}", states=STATE_SETS)
    await store.migrate()
    resources = ("a", "b", "c")

    def take() -> Any:
        return storeops.reserve_active(
            store,
            new_lease(),
            "static",
            Terms(NOW, resources=resources),
            lambda r: (r, r),
        )

    try:
        first = await take()
        assert first.resource == "a"
        assert await store.claim_release(
            first.lease_id,
            ReleaseReason.explicit,
            states.RELEASE,
            now=NOW + 1,
            at_once=(states.RELEASE_AT_ONCE, ("static",)),
        )
        second = await take()
        assert second.resource == "a"  # free again at once

        # Another connection writes a live lease holding "b".
        columns = [c.name for c in schema.leases.columns]
        chosen = [{"lease_id": "?", "resource": "'b'"}.get(c, c) for c in columns]
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as tool:
            tool.execute(
                f"INSERT INTO leases ({', '.join(columns)}) "
                f"SELECT {', '.join(chosen)} FROM leases WHERE lease_id = ?",
                (str(uuid.uuid4()), second.lease_id),
            )
        third = await take()
        assert third.resource == "c"

        # "a" freed by claim_release + finish_release: the next lease gets it.
        await store.claim_release(
            second.lease_id, ReleaseReason.explicit, states.RELEASE, now=NOW + 2
        )
        await store.finish_release(second.lease_id, states.FINISH, now=NOW + 2)
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
        await storeops.reserve(store, lease, "p", Terms(NOW, max_live=0, resources=None))

    def renew_then_fail(conn: Connection, lease_id: str) -> None:
        conn.execute(
            update(schema.leases)
            .where(schema.leases.c.lease_id == lease_id)
            .values(expires_at=NOW + 999)
        )
        raise RuntimeError("after writing")

    def refuse(_conn: Connection) -> None:
        raise LookupError("before writing")

    outcomes = await asyncio.gather(
        store.activate(
            leases[0].lease_id, states.ACTIVATE, endpoint="e0", provider_token="t", now=NOW
        ),
        store.backend.write(renew_then_fail, leases[1].lease_id),
        store.activate(
            leases[2].lease_id, states.ACTIVATE, endpoint="e2", provider_token="t", now=NOW
        ),
        store.backend.write(refuse),
        store.activate(
            leases[3].lease_id, states.ACTIVATE, endpoint="e3", provider_token="t", now=NOW
        ),
        return_exceptions=True,
    )
    assert isinstance(outcomes[1], RuntimeError) and isinstance(outcomes[3], LookupError)
    for place in (0, 2, 4):
        assert outcomes[place] is not None and outcomes[place].state == "active"
    stored = {lease.lease_id: await store.get(lease.lease_id) for lease in leases}
    assert [stored[lease.lease_id].state for lease in leases] == [
        "active",
        "provisioning",
        "active",
        "active",
        "provisioning",
        "provisioning",
    ]
    assert stored[leases[1].lease_id].expires_at == leases[1].expires_at


async def test_a_write_lock_held_by_another_process_is_waited_for_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding the SQLite file's write lock: writes wait without stopping
    the event loop; reads go on; past the timeout the write is StoreUnavailable (503),
    and once the lock is let go the same write succeeds: nothing was half done."""
    monkeypatch.setattr(sqlite, "WRITE_LOCK_TIMEOUT_S", 0.5)
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}", states=STATE_SETS)
    await store.migrate()
    lease = new_lease()
    tool = sqlite3.connect(tmp_path / "store.db", isolation_level=None)
    tool.execute("BEGIN IMMEDIATE")
    try:
        writing = asyncio.create_task(
            storeops.reserve(store, lease, "p", Terms(NOW, max_live=0, resources=None))
        )
        # Reads answer meanwhile, one after another, each a round trip through the loop.
        reads = 0
        while reads < 10 and not writing.done():
            assert await store.get(lease.lease_id) is None
            reads += 1
        with pytest.raises(StoreUnavailable, match="write lock"):
            await writing
    finally:
        tool.execute("ROLLBACK")
        tool.close()
    # The loop ran on while the write waited (a wait inside SQLite would have stopped it
    # for the whole half second: a read or two at most, before and after).
    assert reads == 10, reads
    await storeops.reserve(store, lease, "p", Terms(NOW, max_live=0, resources=None))
    stored = await store.get(lease.lease_id)
    assert stored is not None and stored.state == "provisioning"
    await store.close()


async def test_a_write_behind_a_waiting_one_gives_up_from_its_own_arrival(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that arrives while another is already waiting for another process's lock
    gets its 503 one timeout after its own arrival, not a timeout after the one ahead of
    it gave up (which made it wait up to twice as long)."""
    monkeypatch.setattr(sqlite, "WRITE_LOCK_TIMEOUT_S", 4.0)
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}", states=STATE_SETS)
    await store.migrate()
    first, second = new_lease(), new_lease()
    loop = asyncio.get_running_loop()
    tool = sqlite3.connect(tmp_path / "store.db", isolation_level=None)
    tool.execute("BEGIN IMMEDIATE")
    try:
        waiting = asyncio.create_task(
            storeops.reserve(store, first, "p", Terms(NOW, max_live=0, resources=None))
        )
        # A read's round trip through a thread lets the loop run the write's first steps:
        # its batch is then with the writer thread, waiting for the lock.
        assert await store.get(first.lease_id) is None
        pending = store.backend._pending  # type: ignore[attr-defined]
        assert not pending, "the first write is not with the writer thread yet"
        arrived = loop.time()
        behind = asyncio.create_task(
            storeops.reserve(store, second, "p", Terms(NOW, max_live=0, resources=None))
        )
        for task in (waiting, behind):
            with pytest.raises(StoreUnavailable, match="write lock"):
                await task
        gave_up = loop.time() - arrived
    finally:
        tool.execute("ROLLBACK")
        tool.close()
    # 4 s after its own arrival; a wait that began only once the first gave up (4 s in)
    # ends 8 s in. The lock was held all along: 1.5 s of room for a loaded machine.
    assert gave_up < 5.5, gave_up
    assert await store.get(first.lease_id) is None
    assert await store.get(second.lease_id) is None
    await store.close()


async def test_sqlite_commits_are_full_synchronous_by_default(tmp_path: Path) -> None:
    """A write is answered after SQLite's own synchronous=FULL commit: the writer's
    connection says so, and the store starts no helper process to make it durable."""
    before = set(children(os.getpid()))
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}", states=STATE_SETS)
    await store.migrate()
    try:
        await storeops.reserve(store, new_lease(), "p", Terms(NOW))
        level = await store.backend.write(
            lambda conn: conn.exec_driver_sql("PRAGMA synchronous").scalar()
        )
        assert level == 2  # FULL
        assert set(children(os.getpid())) - before == set()
    finally:
        await store.close()


async def test_a_failed_commit_fails_every_write_of_its_batch_and_keeps_none(
    tmp_path: Path,
) -> None:
    """The writes of several callers share one transaction. When its COMMIT fails (here
    SQLite refuses the statement: an authorizer denies COMMIT on the writer's own
    connection), no caller of that batch is told success, and nothing of the batch is
    in the file afterwards; the next batch commits again."""
    store = open_store(f"sqlite:///{tmp_path / 'store.db'}", states=STATE_SETS)
    await store.migrate()
    deny = {"on": False}

    def refuse_commit(action: int, arg1: Any, *_rest: Any) -> int:
        if deny["on"] and action == sqlite3.SQLITE_TRANSACTION and arg1 == "COMMIT":
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    def install(conn: Connection) -> None:
        conn.connection.driver_connection.set_authorizer(refuse_commit)  # type: ignore[union-attr]

    try:
        await store.backend.write(install)
        deny["on"] = True
        leases = [new_lease() for _ in range(4)]
        outcomes = await asyncio.gather(
            *(storeops.reserve(store, lease, "p", Terms(NOW)) for lease in leases),
            return_exceptions=True,
        )
        assert all(isinstance(o, StoreUnavailable) for o in outcomes), outcomes
        with contextlib.closing(sqlite3.connect(tmp_path / "store.db")) as other:
            assert other.execute("SELECT count(*) FROM leases").fetchone()[0] == 0
        for lease in leases:
            assert await store.get(lease.lease_id) is None
        deny["on"] = False
        await storeops.reserve(store, leases[0], "p", Terms(NOW))
        assert (await store.get(leases[0].lease_id)) is not None
    finally:
        await store.close()


async def test_a_database_file_that_cannot_be_opened_fails_its_writes_instead_of_hanging(
    tmp_path: Path,
) -> None:
    """The writer opens its connection at the first write. When that fails (here the
    file was replaced by a directory after start-up), the writes waiting for it fail
    with 503, none waits forever, and writing works again once the file can be opened."""
    path = tmp_path / "store.db"
    store = open_store(f"sqlite:///{path}", states=STATE_SETS)
    path.unlink(missing_ok=True)
    path.mkdir()
    try:
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(store.migrate(), 30)
        path.rmdir()
        await asyncio.wait_for(store.migrate(), 30)
        assert await store.get(str(uuid.uuid4())) is None
    finally:
        await store.close()


# A session of this database waiting for advisory lock 7 (its key's low half: objid).
WAITING_FOR_LOCK_7 = """
    SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
    WHERE d.datname = current_database() AND l.locktype = 'advisory' AND l.objid = 7
      AND NOT l.granted
"""


async def test_a_pool_with_no_connection_to_lend_is_unavailable_not_an_error(
    tmp_path: Path,
) -> None:
    """A burst bigger than the PostgreSQL pool waited past the pool's timeout and was
    answered 500 (the pool's timeout was not a store outage to `guarded`); it is 503
    `store_unavailable`, which callers retry. A real pool of one connection, held by a
    transaction that waits on a lock another session holds."""
    import asyncpg
    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from openalice_scheduler.store.postgres import PostgresBackend

    with database_url("postgresql", tmp_path) as url:
        backend = PostgresBackend(make_url(url), pool_max=1, pool_wait_s=0.2)
        other = await asyncpg.connect(url)
        try:
            await other.execute("SELECT pg_advisory_lock(7)")
            holding = asyncio.create_task(
                backend.write(lambda conn: conn.execute(text("SELECT pg_advisory_xact_lock(7)")))
            )
            # It has the pool's one connection, and waits for the lock: the server says so.
            loop = asyncio.get_running_loop()

            def waits_for_the_lock() -> bool:
                asked = other.fetchval(WAITING_FOR_LOCK_7)  # on the loop, from the poll's thread
                return bool(asyncio.run_coroutine_threadsafe(asked, loop).result(10))

            await asyncio.to_thread(
                wait_for, waits_for_the_lock, 30, what="the write to wait for the lock"
            )
            assert not holding.done()
            with pytest.raises(StoreUnavailable):
                await backend.read(lambda conn: conn.execute(text("SELECT 1")).scalar())
            await other.execute("SELECT pg_advisory_unlock(7)")
            await asyncio.wait_for(holding, 10)
            # Lent again once free.
            assert await backend.read(lambda conn: conn.execute(text("SELECT 1")).scalar()) == 1
        finally:
            await other.close()
            await backend.close()


async def test_a_lock_left_by_a_killed_process_is_taken_at_once_in_a_store_of_its_own(
    tmp_path: Path,
) -> None:
    # A scheduler killed in the middle of a reconcile pass leaves the lock held for its
    # TTL. On SQLite nobody else uses the store: the restarted one takes it at once, so
    # its start-up reconciliation runs (seen failing under load: a pod left behind).
    with database_url("sqlite", tmp_path) as url:
        gone = open_store(url, states=STATE_SETS)
        await gone.migrate()
        assert await gone.replicas.try_lock("reconcile", ttl_us=180_000_000, now=NOW)
        await gone.close()  # kill -9: no unlock
        again = open_store(url, states=STATE_SETS)
        await again.migrate()
        assert await again.replicas.try_lock("reconcile", ttl_us=180_000_000, now=NOW + 1)
        await again.close()
