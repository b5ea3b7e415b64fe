"""Fencing tokens (issue 16, item 7): every lease's `fence` is strictly increasing over
all leases of a store, across replicas and restarts, kept by renewals, and given to the
worker (LEASE_FENCE in its environment, `fence` in a warm hand-off)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic import command
from alembic.config import Config
from sqlalchemy import text

from openalice_scheduler.lifecycle.states import STATE_SETS
from openalice_scheduler.store import Terms, open_store
from tests import storeops
from tests.harness import Scheduler, database_url, docker_client, new_lease_at
from tests.test_replicas import Replicas, burst, expect, replicas  # noqa: F401 - the fixture
from tests.test_warm_pool import POOL_ENV, warm_renderers, worker_page
from tests.test_worker_self import image  # noqa: F401 - the fixture

Make = Callable[..., Scheduler]
MIGRATIONS = Path(__file__).resolve().parent.parent / "src/openalice_scheduler/store/migrations"
# Static endpoints: leases made and ended in one transaction each, so a thousand of them
# take seconds, and each endpoint is leased again and again.
STATIC = {
    "PROVIDERS": "static",
    "STATIC_WORKERS": "renderer=" + ",".join(f"http://w{i}:8080" for i in range(200)),
}
NOW = 1_800_000_000_000_000


# About a minute in a run of the suite; 145 s with ten test workers and three busy loops
# on two cores: past the suite's 180 s bound on a host slower still.
@pytest.mark.timeout(400)
def test_a_thousand_leases_over_two_replicas_have_unique_increasing_fences(
    replicas: Replicas,  # noqa: F811 - the fixture
) -> None:
    group = replicas(2, **STATIC)
    # One after another, alternating replicas: each fence is larger than the one before.
    fences, by_endpoint = [], {}
    for i in range(1000):
        lease = group[i % 2].lease(kind="renderer")
        fences.append(lease["fence"])
        by_endpoint.setdefault(lease["endpoint"], []).append(lease["fence"])
        assert group[(i + 1) % 2].release(lease["lease_id"]).status_code == 204
    assert all(isinstance(f, int) for f in fences)
    assert all(a < b for a, b in zip(fences, fences[1:], strict=False)), "not increasing"
    # Each endpoint served many leases, each with a larger fence than its last one.
    assert max(len(f) for f in by_endpoint.values()) > 1
    # At once, split between the replicas: unique, and above every earlier one.
    answers = burst([(group[i % 2], {"kind": "renderer"}) for i in range(200)])
    expect(answers, {200: 200})
    batch = [r.json()["lease"]["fence"] for r in answers]
    assert len(set(batch)) == 200
    assert min(batch) > fences[-1]


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_after_a_restart_the_next_fence_is_larger_than_all_before(
    make_scheduler: Make,
    tmp_path: Path,
    kind: str,
) -> None:
    with database_url(kind, tmp_path) as url:
        sched = make_scheduler(DATABASE_URL=url, **STATIC)
        before = [sched.lease(kind="renderer")["fence"] for _ in range(5)]
        sched.kill()  # kill -9: nothing is flushed or saved on the way out
        sched.start()
        after = sched.lease(kind="renderer")
        assert after["fence"] > max(before)
        sched.kill()


def test_a_renewal_keeps_the_fence(make_scheduler: Make) -> None:
    sched = make_scheduler(**STATIC)
    lease = sched.lease(kind="renderer", ttl_seconds=60)
    later = sched.lease(kind="renderer")
    renewed = sched.http.post(f"/v1/lease/{lease['lease_id']}/renew", json={"ttl_seconds": 600})
    assert renewed.status_code == 200, renewed.text
    assert renewed.json()["expires_at"] != lease["expires_at"]
    assert renewed.json()["fence"] == lease["fence"] < later["fence"]
    assert sched.http.get(f"/v1/lease/{lease['lease_id']}").json()["fence"] == lease["fence"]
    listed = {x["lease_id"]: x["fence"] for x in sched.leases()}
    assert listed == {lease["lease_id"]: lease["fence"], later["lease_id"]: later["fence"]}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
async def test_the_migration_numbers_existing_leases_in_created_order(
    tmp_path: Path,
    kind: str,
) -> None:
    with database_url(kind, tmp_path) as url:
        store = open_store(url, states=STATE_SETS)
        await store.backend.schema(_upgrade_to, "0007")
        # Three leases recorded before fences existed, inserted out of created order.
        made = {str(uuid.uuid4()): NOW + n for n in (3, 1, 2)}
        await store.backend.schema(_insert_old, made)
        await store.migrate()
        by_created = sorted(made, key=made.__getitem__)
        assert [(await store.get(i)).fence for i in by_created] == [1, 2, 3]  # type: ignore[union-attr]
        new = new_lease_at(NOW)
        assert (await storeops.reserve_lease(store, new, "p", Terms(NOW))).fence == 4
        await store.close()


def test_a_worker_is_told_its_fence_cold_and_warm(
    make_scheduler: Make,
    image: dict[str, str],  # noqa: F811 - the fixture
) -> None:
    sched = warm_renderers(make_scheduler, 1, **POOL_ENV, **image)
    [idle] = sched.http.get("/v1/leases", params={"state": "idle"}).json()
    # Cold (a kind without a pool): LEASE_FENCE in the container's environment.
    cold = sched.lease(kind="anim")
    assert _env(cold["provider_token"])["LEASE_FENCE"] == str(cold["fence"])
    # The idle pool worker started with a fence of its own; its claim is a new lease,
    # with a larger fence than anything before, which the hand-off tells the worker.
    assert _env(idle["provider_token"])["LEASE_FENCE"] == str(idle["fence"])
    warm = sched.lease(kind="renderer", env={"SCENE": "intro"})
    assert warm["lease_id"] == idle["lease_id"]
    assert warm["fence"] > max(idle["fence"], cold["fence"])
    page = worker_page(warm["provider_token"])
    assert page["handoff"]["fence"] == warm["fence"]
    assert page["fence"] == warm["fence"]
    # Without SCHEDULER_PUBLIC_URL the worker is given no way to the scheduler.
    assert "token" not in page["handoff"] and "self_url" not in page["handoff"]
    assert "LEASE_TOKEN" not in _env(cold["provider_token"])


def _env(container_id: str) -> dict[str, str]:
    config = docker_client().api.inspect_container(container_id)["Config"]
    return dict(item.split("=", 1) for item in config["Env"])


def _upgrade_to(conn: object, revision: str) -> None:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    command.upgrade(config, revision)


def _insert_old(conn: object, made: dict[str, int]) -> None:
    for lease_id, created in made.items():
        conn.execute(
            text(  # type: ignore[attr-defined]
                "INSERT INTO leases (lease_id, provider, kind, gpu, state, endpoint, "
                "provider_token, ttl_seconds, created_at, expires_at, release_attempts, "
                "updated_at) VALUES (:id, 'p', 'renderer', 'none', 'active', '', '', 60, "
                ":created, :expires, 0, :created)"
            ),
            {"id": lease_id, "created": created, "expires": created + 60_000_000},
        )
