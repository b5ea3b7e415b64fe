"""GET /v1/usage, the `usage` command and the purge of ended leases past retention
(docs/concepts/money.md#usage-and-retention): a real scheduler over HTTP with Docker workers at a
price, and the purge against a real store on each database."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import Insert, select

from openalice_scheduler.lifecycle.states import STATE_SETS
from openalice_scheduler.store import LeaseStore
from openalice_scheduler.store.schema import leases
from openalice_scheduler.store.usage import purge_ended, usage
from tests.forked import run_to_end
from tests.harness import SECRET, Scheduler, wait_for

# 3.6 $/h: a second held costs a tenth of a cent, so costs show after a short test.
PRICE = "3.6"
DAY_US = 86_400_000_000
# The columns of a lease row that no test here is about.
LEASE_COLUMNS = {
    "provider": "local-docker",
    "kind": "renderer",
    "gpu": "none",
    "ttl_seconds": 60,
    "release_attempts": 0,
    "endpoint": "",
    "provider_token": "",
}


@pytest.fixture
def priced(make_scheduler: Callable[..., Scheduler]) -> Scheduler:
    return make_scheduler(LOCAL_DOCKER_PRICE_PER_HOUR=PRICE)


def test_usage_per_owner_counts_live_and_released_leases(priced: Scheduler) -> None:
    priced.lease(owner_id="anim")
    a2 = priced.lease(owner_id="anim")
    priced.lease(owner_id="render")
    priced.lease()
    assert priced.release(a2["lease_id"], owner="anim").status_code == 204

    answer = priced.http.get("/v1/usage", params={"group_by": "owner"})
    assert answer.status_code == 200, answer.text
    report = answer.json()
    groups = {g["key"]: g for g in report["groups"]}
    assert set(groups) == {"anim", "render", None}
    assert (groups["anim"]["leases"], groups["anim"]["live"]) == (2, 1)
    assert (groups["render"]["leases"], groups["render"]["live"]) == (1, 1)
    assert all(g["cost"] > 0 and g["lease_hours"] > 0 for g in groups.values())
    # Cost is the price times the hours held, and the groups add up to the total.
    for g in groups.values():
        assert g["cost"] == pytest.approx(g["lease_hours"] * float(PRICE), abs=1e-5)
    assert report["total"]["leases"] == 4 and report["total"]["live"] == 3
    assert report["total"]["cost"] == pytest.approx(
        sum(g["cost"] for g in groups.values()), abs=1e-5
    )
    costs = [g["cost"] for g in report["groups"]]
    assert costs == sorted(costs, reverse=True)
    assert report["complete"] is True and report["note"] is None
    # The released lease's part equals its recorded cost.
    released = priced.http.get(f"/v1/lease/{a2['lease_id']}").json()
    assert released["cost"] > 0
    assert groups["anim"]["cost"] > released["cost"]

    by_provider = priced.http.get("/v1/usage", params={"group_by": "provider"}).json()
    assert [g["key"] for g in by_provider["groups"]] == ["local-docker"]
    assert by_provider["groups"][0]["leases"] == 4


def test_usage_period_before_the_leases_is_empty_and_beyond_retention_incomplete(
    priced: Scheduler,
) -> None:
    priced.lease(owner_id="anim")
    report = priced.http.get(
        "/v1/usage", params={"since": "2020-01-01", "until": "2020-01-02T00:00:00Z"}
    ).json()
    assert report["groups"] == [] and report["total"]["leases"] == 0
    assert report["since"].startswith("2020-01-01T00:00:00")
    assert report["complete"] is False
    assert "purged" in report["note"] and report["retention_days"] == 90


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"since": "yesterday"}, "since"),
        ({"until": "2026-13-01"}, "until"),
        ({"since": "2026-11-30T12:00:00"}, "since"),  # no UTC offset
        ({"since": "2026-12-01", "until": "2026-11-30"}, "since"),
        ({"until": "9999-12-31T23:59:59-01:00"}, "until"),
        # Regression: a 500, as the default since (24 h before) is before year 1.
        ({"until": "0001-01-01T12:00:00Z"}, "until"),
        ({"group_by": "colour"}, "group_by"),
    ],
)
def test_bad_usage_parameters_are_422_naming_them(
    sched: Scheduler,
    params: dict[str, str],
    field: str,
) -> None:
    answer = sched.http.get("/v1/usage", params=params)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"] == "invalid_request"
    assert answer.json()["field"] == field


def test_usage_needs_the_secret(sched: Scheduler) -> None:
    assert sched.http.get("/v1/usage", headers={"X-Internal-Secret": "wrong"}).status_code == 401


def _cli(sched: Scheduler, *args: str) -> subprocess.CompletedProcess[str]:
    """`openalice-scheduler usage --url URL ARGS...` in a process of its own (forked with
    the CLI already imported: tests/forked.py)."""
    env = {**os.environ, "INTERNAL_SECRET": SECRET, "COLUMNS": "200"}
    return run_to_end(["usage", "--url", sched.url, *args], env, Path.cwd(), timeout=60)


def test_a_cost_is_rounded_once_where_it_is_shown() -> None:
    # Held 0.9027666 s at 0.6 $/h: 0.000150461 $, 0.0002 to the hundredth of a cent.
    # The API once rounded it to 0.00015 first, which the command showed as 0.0001.
    from openalice_scheduler.cli.usage import _amount
    from openalice_scheduler.store.usage import Tally

    tally = Tally()
    tally.add(live=False, held=902_766, price=0.6)
    figures = tally.figures()
    assert figures.cost == tally.cost
    assert _amount(figures.cost) == "0.0002"


def test_usage_command_shows_spend_per_owner(priced: Scheduler) -> None:
    ended = priced.lease(owner_id="anim")
    assert priced.release(ended["lease_id"], owner="anim").status_code == 204
    cost = priced.http.get(f"/v1/lease/{ended['lease_id']}").json()["cost"]
    table = _cli(priced, "--since", "1h", "--by", "owner")
    assert table.returncode == 0, table.stderr
    assert "anim" in table.stdout and "cost $" in table.stdout and "total" in table.stdout
    # What it cost, to the hundredth of a cent: a short lease does not show as 0.00.
    assert 0 < cost < 1 and f"{cost:.4f}" in table.stdout, (cost, table.stdout)
    priced.lease(owner_id="anim")

    as_json = _cli(priced, "--since", "today", "--json")
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    midnight = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    assert report["since"].startswith(midnight.strftime("%Y-%m-%dT00:00:00"))
    assert [g["key"] for g in report["groups"]] == ["anim"]

    yesterday = _cli(priced, "--since", "yesterday", "--until", "today", "--json")
    assert yesterday.returncode == 0, yesterday.stderr
    assert json.loads(yesterday.stdout)["groups"] == []  # the lease began today
    assert json.loads(yesterday.stdout)["since"].startswith(
        (midnight - timedelta(days=1)).strftime("%Y-%m-%d")
    )

    bad = _cli(priced, "--since", "last week")
    assert bad.returncode == 2 and "--since" in bad.stderr


def lease_row(lease_id: str, created_at: int, **columns: object) -> Insert:
    """The insert of one row of the leases table: a renderer without a GPU on local
    Docker for 60 s, no release attempted, expiring, updated and granted when it was
    created unless `columns` say otherwise (they give its state, release and price)."""
    made = {"expires_at": created_at, "updated_at": created_at, "granted_at": created_at}
    return leases.insert().values(
        lease_id=lease_id, created_at=created_at, **{**LEASE_COLUMNS, **made, **columns}
    )


async def write_rows(store: LeaseStore, inserts: list[Insert]) -> None:
    """The inserts, in one transaction of the store."""

    def write(conn, *_: object) -> None:  # type: ignore[no-untyped-def]
        for insert in inserts:
            conn.execute(insert)

    await store.backend.write(write)


async def test_purge_removes_old_ended_leases_only(store: LeaseStore) -> None:
    now = 1_800_000_000_000_000
    old, recent = now - 100 * DAY_US, now - DAY_US
    rows = {
        "old-released": ("released", old),
        "old-failed": ("failed", old),
        "recent-released": ("released", recent),
        "live": ("active", None),
        "old-live": ("active", None),
    }

    inserts = []
    for lease_id, (state, released_at) in rows.items():
        created = old - DAY_US if lease_id.startswith("old") else recent - DAY_US
        inserts.append(
            lease_row(lease_id, created, state=state, released_at=released_at, price_per_hour=1.0)
        )
    await write_rows(store, inserts)
    # A batch of one: the purge goes on until nothing old is left.
    before = now - 90 * DAY_US
    assert await purge_ended(store.backend, STATE_SETS.ended, before=before, batch=1) == 2
    assert await purge_ended(store.backend, STATE_SETS.ended, before=before) == 0  # idempotent
    left = await store.backend.read(
        lambda conn: sorted(r[0] for r in conn.execute(select(leases.c.lease_id)))
    )
    assert left == ["live", "old-live", "recent-released"]


def test_the_service_purges_old_ended_leases_in_the_background(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler(LEASE_RETENTION_DAYS="30")
    kept = sched.lease(owner_id="anim")
    ended = sched.lease(owner_id="anim")
    assert sched.release(ended["lease_id"], owner="anim").status_code == 204
    sched.stop()
    # Rows from long ago, written into the store file the service uses.
    path = sched.env["DATABASE_URL"].removeprefix("sqlite:///")
    old = int((datetime.now(UTC) - timedelta(days=40)).timestamp() * 1_000_000)
    with sqlite3.connect(path) as db:
        for lease_id, state in (("old-released", "released"), ("old-failed", "failed")):
            db.execute(
                "INSERT INTO leases (lease_id, provider, kind, gpu, state, endpoint, "
                "provider_token, ttl_seconds, created_at, expires_at, updated_at, "
                "released_at, release_attempts, granted_at, price_per_hour) VALUES "
                "(?, 'local-docker', 'renderer', 'none', ?, '', '', 60, ?, ?, ?, ?, 0, ?, 1.0)",
                (lease_id, state, old, old, old, old, old),
            )
    sched.start()
    wait_for(
        lambda: "purged 2 ended leases older than 30 days" in sched.log(),
        timeout=30,
        what="the purge's log line",
    )
    for lease_id in ("old-released", "old-failed"):
        assert sched.http.get(f"/v1/lease/{lease_id}").status_code == 404
    assert sched.http.get(f"/v1/lease/{ended['lease_id']}").json()["state"] == "released"
    assert sched.http.get(f"/v1/lease/{kept['lease_id']}").json()["state"] == "active"
    # What usage over the purged days says.
    report = sched.http.get("/v1/usage", params={"since": "2020-01-01"}).json()
    assert report["complete"] is False and "LEASE_RETENTION_DAYS" in report["note"]


async def test_usage_counts_only_the_part_of_each_lease_inside_the_period(
    store: LeaseStore,
) -> None:
    hour = 3_600_000_000
    since, until = 1_800_000_000_000_000, 1_800_000_000_000_000 + 24 * hour
    # Each row's owner, state, granted_at, released_at and price.
    columns = ("owner_id", "state", "granted_at", "released_at", "price_per_hour")
    rows = {
        "before": ("a", "released", since - 3 * hour, since - hour, 1.0),  # outside
        "across-start": ("a", "released", since - hour, since + 2 * hour, 1.0),  # 2 h in
        "inside": ("b", "released", since + hour, since + 4 * hour, 2.0),  # 3 h
        "still-live": ("b", "active", until - hour, None, 2.0),  # 1 h up to until
        "never-granted": ("b", "failed", None, since + hour, 2.0),  # nothing
    }

    await write_rows(
        store,
        [
            lease_row(
                lease_id,
                since - 4 * hour,
                expires_at=until,
                updated_at=since,
                **dict(zip(columns, values, strict=True)),
            )
            for lease_id, values in rows.items()
        ],
    )
    found = await usage(store.backend, "owner", since=since, until=until, now=until + hour)
    by_owner = dict(found.by_cost())
    assert list(by_owner) == ["b", "a"]  # by cost: b 8 $, a 2 $
    assert (by_owner["a"].leases, by_owner["a"].live) == (1, 0)
    assert by_owner["a"].lease_hours == pytest.approx(2.0)
    assert by_owner["a"].cost == pytest.approx(2.0)
    assert (by_owner["b"].leases, by_owner["b"].live) == (2, 1)
    assert by_owner["b"].lease_hours == pytest.approx(4.0)
    assert by_owner["b"].cost == pytest.approx(8.0)
    assert found.total.cost == pytest.approx(10.0) and found.total.leases == 3
