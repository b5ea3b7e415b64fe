"""What leases cost, and caps per owner in money (docs/concepts/money.md#prices-and-caps), with the
real service over HTTP, real Docker workers and the RunPod emulator's priced catalog:

- a RunPod lease records the pod's own GPU type and price (GraphQL has no catalog: only
  the pod's answer can say), a CPU pod its own cost; a Docker lease its class's price;
  a released lease's cost is price × the time from grant to release, and goes on the
  spend counter;
- providers whose price breaks an owner's hourly cap are skipped, and when none is
  left the answer is 429 `budget_exceeded` naming the cap, the owner's figures and the
  cheapest price refused; on RunPod, a cap below every GPU type's price refuses;
- concurrent acquires against an hourly cap, on two replicas of one PostgreSQL, admit
  exactly what fits;
- the daily cap holds across a kill -9 and restart;
- callers waiting in line for capacity are not woken into a breach."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import Scheduler, clean_up_all, database_url, wait_for
from tests.runpod_emulator import RunPodEmulator
from tests.runpod_setup import pods_of

KEY = "rpk-money-" + uuid.uuid4().hex  # the emulator's (conftest's `runpod_server`)
A6000 = "NVIDIA RTX A6000"  # the cheapest mid GPU in the emulator's catalog (0.49 $/h)
# GraphQL has no catalog to order the candidates by price: it tries them in the configured
# order, so the cheapest goes first, where REST puts it too.
CHEAPEST_FIRST = {"RUNPOD_GPU_MID": f"{A6000},NVIDIA L40S"}


def seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def held_cost(lease: dict[str, Any]) -> float:
    held = seconds(lease["released_at"]) - seconds(lease["granted_at"])
    return float(lease["price_per_hour"]) * held / 3600


def spent_so_far(sched: Scheduler, owner: str) -> float:
    """What `owner`'s leases cost so far, live ones up to now, as the scheduler counts
    it (GET /v1/usage, the last 24 h)."""
    report = sched.http.get("/v1/usage", params={"group_by": "owner"}).json()
    return sum(group["cost"] for group in report["groups"] if group["key"] == owner)


def refused_for_budget(response: httpx.Response, cap: str, limit: float) -> dict[str, Any]:
    """A 429 `budget_exceeded` naming the cap that refused and its limit: its body."""
    assert response.status_code == 429, response.text
    body: dict[str, Any] = response.json()
    assert body["error"] == "budget_exceeded"
    assert body["cap"] == cap and body["limit"] == limit
    return body


def test_a_runpod_lease_records_the_pods_own_gpu_type_price_and_cost(
    api: str, on_runpod: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    runpod.set_price(A6000, secure=0.61)  # what the pod is billed, not the default 0.49
    sched = on_runpod(api, **CHEAPEST_FIRST)
    lease = sched.lease(gpu="mid", owner_id="anim", ttl_seconds=600)
    assert lease["gpu_type"] == A6000
    assert lease["price_per_hour"] == pytest.approx(0.61)
    assert lease["granted_at"] is not None and lease["cost"] is None
    assert sched.metric("scheduler_live_cost_per_hour_dollars", provider="runpod") == pytest.approx(
        0.61
    )
    # Held until the scheduler counts 1.5 s of it.
    wait_for(
        lambda: spent_so_far(sched, "anim") >= 0.61 * 1.5 / 3600,
        60,
        0.1,
        what="1.5 s of the lease's price spent",
    )
    assert sched.release(lease["lease_id"], owner="anim").status_code == 204
    ended = sched.http.get(f"/v1/lease/{lease['lease_id']}").json()
    assert ended["state"] == "released"
    assert ended["cost"] == pytest.approx(held_cost(ended), rel=1e-6)
    assert ended["cost"] > 0.61 * 1.5 / 3600
    assert sched.metric("scheduler_spend_dollars_total", provider="runpod") == pytest.approx(
        ended["cost"], rel=1e-6
    )
    assert sched.metric("scheduler_live_cost_per_hour_dollars", provider="runpod") == 0


def test_a_runpod_cpu_pod_is_priced_by_its_own_answer(
    on_runpod: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    """The catalog prices GPUs only: a CPU pod's price comes from the pod itself."""
    sched = on_runpod("rest", **CHEAPEST_FIRST)
    lease = sched.lease(gpu="none", ttl_seconds=600)
    assert lease["gpu_type"] is None
    assert lease["price_per_hour"] == pytest.approx(0.08)  # cpu5c: 2 vCPU × 0.04 $/h


def test_a_cap_below_every_runpod_price_refuses_naming_the_cheapest(
    on_runpod: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    sched = on_runpod("rest", **CHEAPEST_FIRST, OWNER_BUDGETS="anim=0.4/h")
    refused = sched.acquire(gpu="mid", owner_id="anim", ttl_seconds=600)
    body = refused_for_budget(refused, "OWNER_BUDGETS (anim=0.4/h)", 0.4)
    assert body["cheapest_refused_price"] == pytest.approx(0.49)
    assert body["owner_cost_per_hour"] == 0
    assert not pods_of(runpod, sched)
    # Another owner has no cap.
    assert sched.lease(gpu="mid", owner_id="live", ttl_seconds=600)[
        "price_per_hour"
    ] == pytest.approx(0.49)


# Two providers for gpu=none at two prices: static at 2 $/h, Docker at 0.5 $/h.
TWO_PRICES = {
    "PROVIDERS": "static,local-docker",
    "STATIC_WORKERS": "renderer=http://127.0.0.1:9",
    "STATIC_PRICE_PER_HOUR": "2",
    "LOCAL_DOCKER_PRICE_PER_HOUR": "none=0.5,entry=3",
}


def test_providers_over_the_hourly_cap_are_skipped_then_refused(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler(**TWO_PRICES, MAX_COST_PER_HOUR_PER_OWNER="1")
    first = sched.lease(owner_id="anim", ttl_seconds=600)
    second = sched.lease(owner_id="anim", ttl_seconds=600)
    # Static (2 $/h) breaks the 1 $/h cap alone: both went to Docker at 0.5 $/h.
    assert [first["provider"], second["provider"]] == ["local-docker"] * 2
    assert first["price_per_hour"] == 0.5 and first["gpu_type"] is None
    refused = sched.acquire(owner_id="anim", ttl_seconds=600)
    body = refused_for_budget(refused, "MAX_COST_PER_HOUR_PER_OWNER", 1)
    assert body["owner_cost_per_hour"] == pytest.approx(1.0)
    assert body["cheapest_refused_price"] == 0.5
    assert "MAX_COST_PER_HOUR_PER_OWNER" in body["message"]
    assert set(body["reasons"]) == {"static", "local-docker"}
    assert len(sched.containers()) == 2  # nothing half-made for the refusal
    assert sched.metric("scheduler_acquire_failures_total", reason="budget") == 1
    # A release makes room again.
    assert sched.release(first["lease_id"], owner="anim").status_code == 204
    assert sched.lease(owner_id="anim", ttl_seconds=600)["provider"] == "local-docker"
    # Caps are per owner: a lease without an owner_id has none, static serves it at 2 $/h.
    assert sched.lease(ttl_seconds=600)["price_per_hour"] == 2


@pytest.fixture
def two_replicas(tmp_path: Path) -> Iterator[list[Scheduler]]:
    instance = f"t-{uuid.uuid4().hex[:10]}"
    with database_url("postgresql", tmp_path) as url:
        replicas = [
            Scheduler(
                tmp_path,
                SCHEDULER_INSTANCE=instance,
                DOCKER_NETWORK=f"oa-{instance}",
                DATABASE_URL=url,
                LOCAL_DOCKER_PRICE_PER_HOUR="1",
                OWNER_BUDGETS="anim=3.5/h",
            )
            for _ in range(2)
        ]
        try:
            replicas[0].start()  # migrates first
            replicas[1].start()
            yield replicas
        finally:
            clean_up_all(replicas)


def test_concurrent_acquires_on_two_replicas_admit_exactly_what_fits(
    two_replicas: list[Scheduler],
) -> None:
    def acquire(index: int) -> httpx.Response:
        replica = two_replicas[index % 2]
        return replica.acquire(owner_id="anim", ttl_seconds=600, correlation_id=f"c{index}")

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(acquire, range(10)))
    granted = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    assert len(granted) == 3, [a.text for a in answers]  # 3 × 1 $/h fit under 3.5 $/h
    assert len(refused) == 7
    assert {a.json()["error"] for a in refused} == {"budget_exceeded"}
    live = [lease for lease in two_replicas[0].leases() if lease["owner_id"] == "anim"]
    assert len(live) == 3
    assert len(two_replicas[0].containers()) == 3


def test_the_daily_cap_holds_across_a_restart(make_scheduler: Callable[..., Scheduler]) -> None:
    # 3600 $/h is 1 $ a second: a few seconds held spend the 3 $ of the day.
    env = {"LOCAL_DOCKER_PRICE_PER_HOUR": "3600", "MAX_SPEND_PER_DAY_PER_OWNER": "3"}
    sched = make_scheduler(**env)
    lease = sched.lease(owner_id="anim", ttl_seconds=600)
    # Held until the scheduler counts more than the day's 3 $ spent on it.
    wait_for(lambda: spent_so_far(sched, "anim") > 3.5, 60, 0.1, what="3.5 $ spent")
    assert sched.release(lease["lease_id"], owner="anim").status_code == 204
    spent = sched.http.get(f"/v1/lease/{lease['lease_id']}").json()["cost"]
    assert spent > 3
    sched.kill()
    again = make_scheduler(
        SCHEDULER_INSTANCE=sched.instance, DATABASE_URL=sched.env["DATABASE_URL"], **env
    )
    refused = again.acquire(owner_id="anim", ttl_seconds=600)
    body = refused_for_budget(refused, "MAX_SPEND_PER_DAY_PER_OWNER", 3)
    assert body["owner_spend_24h"] == pytest.approx(spent, rel=1e-6)
    assert not again.containers()
    assert again.lease(owner_id="live", ttl_seconds=600)["price_per_hour"] == 3600


def test_waiting_callers_are_not_woken_into_a_breach(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler(
        LOCAL_DOCKER_MAX_WORKERS="2", LOCAL_DOCKER_PRICE_PER_HOUR="1", OWNER_BUDGETS="anim=1.5/h"
    )
    holders = [sched.lease(owner_id="other", ttl_seconds=600) for _ in range(2)]
    answers: list[httpx.Response] = []

    def wait_in_line(n: int) -> None:
        answers.append(
            sched.acquire(owner_id="anim", ttl_seconds=600, wait_seconds=60, correlation_id=f"w{n}")
        )

    waiters = [threading.Thread(target=wait_in_line, args=(n,)) for n in range(2)]
    for waiter in waiters:
        waiter.start()
    wait_for(
        lambda: sched.metric("scheduler_waiting_callers", kind="renderer", gpu="none") == 2,
        20,
        what="two callers in line",
    )
    assert sched.release(holders[0]["lease_id"], owner="other").status_code == 204
    # One is served; the other is then refused at once, long before its wait ends: no
    # room the cluster could free would fit its cap any more, so it waits for none
    # (docs/concepts/priorities.md#the-admission-loop).
    for waiter in waiters:
        waiter.join(30)
    assert sorted(a.status_code for a in answers) == [200, 429], [a.text for a in answers]
    refused = next(a for a in answers if a.status_code == 429)
    assert refused.json()["error"] == "budget_exceeded"
    assert holders[1]["lease_id"] in {lease["lease_id"] for lease in sched.leases()}
    anim = [lease for lease in sched.leases() if lease["owner_id"] == "anim"]
    assert len(anim) == 1
