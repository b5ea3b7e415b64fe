"""Warm pools (issue 15, items 4-8), on the real Docker engine, the service over HTTP:

- a warm acquire is served by a container that existed before the request, carries the
  caller's env through the hand-off (and never into the log or the store), learns its
  renewals, and the pool refills; `GET /v1/providers` and scheduler_pool_idle show it;
- 50 concurrent acquires against a pool of 10: all served, 10 of them by the pool's
  workers, no worker handed to two leases;
- `kill -9` with idle and just-claimed pool workers, then a restart: the claimed worker
  is destroyed (never handed out), the idle ones adopted, nothing leaked;
- a cold gpu=entry acquire gets the device an idle pool worker held;
- two replicas on PostgreSQL fill one pool together without over-filling it;
- the demo worker takes the hand-off at the default WARM_HANDOFF_PATH: WARM_POOL alone
  makes a working pool (scripts/serve-demo's case);
- a worker image without the hand-off switches its kind's pool off: acquires go cold;
- a WARM_POOL that does not parse stops start-up, naming the problem."""

from __future__ import annotations

import calendar
import contextlib
import json
import shutil
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from tests.dockerproxy import DockerProxy
from tests.engines import PrivateEngine
from tests.harness import HTTP, SECRET, TLS, Scheduler, docker_client, printed_in, wait_for
from tests.test_docker_provider import device_ids
from tests.test_replicas import Replicas, replicas  # noqa: F401 - the fixture

Make = Callable[..., Scheduler]
LEASE_LABEL = "openalice.scheduler.lease_id"
# The demo worker answers the hand-off at the default WARM_HANDOFF_PATH, /openalice/lease.
POOL_ENV = {
    "RENDERER_READY_PATH": "/healthz",
    "ANIM_READY_PATH": "/healthz",
}


def idle(sched: Scheduler, kind: str = "renderer", gpu: str = "none") -> float:
    return sched.metric("scheduler_pool_idle", kind=kind, gpu=gpu)


def wait_idle(sched: Scheduler, n: int, timeout: float = 60, **labels: str) -> None:
    wait_for(lambda: idle(sched, **labels) == n, timeout, 0.1, what=f"{n} idle pool workers")


def warm_renderers(make_scheduler: Make, n: int, timeout: float = 60, **env: str) -> Scheduler:
    """A scheduler whose pool of renderers without a GPU holds `n` workers, once all `n`
    are idle."""
    sched = make_scheduler(WARM_POOL=f"renderer/none={n}", **env)
    wait_idle(sched, n, timeout)
    return sched


def handed_over_warm(
    sched: Scheduler, page: Callable[[dict[str, Any]], dict[str, Any]]
) -> dict[str, Any]:
    """A renderer lease (with env) served by the pool's idle worker, once there is one;
    the worker's page (`page(lease)`) shows the hand-off with the lease and its env."""
    wait_idle(sched, 1)
    [idle] = sched.http.get("/v1/leases", params={"state": "idle"}).json()
    lease = sched.lease(kind="renderer", owner_id="warm", ttl_seconds=300, env={"SHOT": "7"})
    assert lease["provider_token"] == idle["provider_token"]  # served warm
    shown = page(lease)
    assert shown["handoff"]["lease_id"] == lease["lease_id"]
    assert shown["handoff"]["env"] == {"SHOT": "7"}
    return lease


def worker_page(container_id: str, engine: Any = None) -> dict[str, Any]:
    """What the worker serves at GET / (its index file, written whole by a rename, read
    inside the container)."""
    container = (engine or docker_client()).containers.get(container_id)
    page = printed_in(container, ["/bin/busybox", "cat", "/www/index.html"])
    try:
        return dict(json.loads(page))
    except ValueError:
        raise AssertionError(f"the worker's page is not JSON: {page[:300]!r}") from None


def ids(sched: Scheduler) -> set[str]:
    return {c.id for c in sched.containers()}


def by_lease(sched: Scheduler) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for container in sched.containers():
        found.setdefault(container.labels[LEASE_LABEL], []).append(container.id)
    return found


def burst(sched: Scheduler, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    barrier = threading.Barrier(len(bodies))

    def one(body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(
            verify=TLS, base_url=sched.url, headers={"X-Internal-Secret": SECRET}, timeout=180
        ) as client:
            barrier.wait(timeout=60)
            return client.post("/v1/lease", json={"kind": "renderer", **body})

    with ThreadPoolExecutor(max_workers=len(bodies)) as threads:
        return list(threads.map(one, bodies))


def test_a_warm_acquire_is_served_by_a_ready_worker_and_the_pool_refills(
    make_scheduler: Make,
) -> None:
    sched = warm_renderers(make_scheduler, 2, **POOL_ENV)
    pool = by_lease(sched)
    assert len(pool) == 2
    [view] = sched.http.get("/v1/providers").json()
    assert view["idle"] == {"renderer": {"none": 2}}
    assert view["in_use"] == 2  # pool workers count against every cap
    # No lease is listed for them: they belong to nobody.
    assert sched.leases() == []
    assert len(sched.http.get("/v1/leases", params={"state": "idle"}).json()) == 2

    secret = "s3cr3t-" + SECRET[-12:]
    requested = time.time()
    lease = sched.lease(
        kind="renderer",
        owner_id="alice",
        ttl_seconds=300,
        env={"API_TOKEN": secret, "SCENE": "intro"},
    )
    # Served by a container made before the request: the pool's, under its own lease id.
    assert lease["lease_id"] in pool and pool[lease["lease_id"]] == [lease["provider_token"]]
    created = docker_client().api.inspect_container(lease["provider_token"])["Created"]
    assert calendar.timegm(time.strptime(created[:19], "%Y-%m-%dT%H:%M:%S")) < requested
    assert lease["owner_id"] == "alice" and lease["state"] == "active"

    # The worker learnt the lease through the hand-off: id, expiry, kind and env.
    page = worker_page(lease["provider_token"])
    assert page["lease_id"] == lease["lease_id"]
    assert page["expires_at"] == lease["expires_at"]
    assert page["handoff"] == {
        "lease_id": lease["lease_id"],
        "kind": "renderer",
        "expires_at": lease["expires_at"],
        "fence": lease["fence"],
        "env": {"API_TOKEN": secret, "SCENE": "intro"},
    }

    # The pool refills at once: two idle again, beside the leased one.
    wait_idle(sched, 2, timeout=30)
    assert len(sched.containers()) == 3

    # A renewal is handed on: the worker learns its new expiry.
    renewed = sched.http.post(
        f"/v1/lease/{lease['lease_id']}/renew",
        headers={"X-Lease-Owner": "alice"},
        json={"ttl_seconds": 900},
    )
    assert renewed.status_code == 200, renewed.text
    assert worker_page(lease["provider_token"])["expires_at"] == renewed.json()["expires_at"]

    # Env values reach the worker only.
    assert secret not in sched.log()
    database = sched.env["DATABASE_URL"].removeprefix("sqlite:///")
    with sqlite3.connect(database) as db:
        dump = "\n".join(db.iterdump())
    assert secret not in dump

    assert sched.release(lease["lease_id"], owner="alice").status_code == 204
    assert lease["provider_token"] not in ids(sched)
    assert idle(sched) == 2


def test_a_burst_bigger_than_the_pool_is_served_warm_then_cold(make_scheduler: Make) -> None:
    sched = warm_renderers(
        make_scheduler, 10, timeout=120, LOCAL_DOCKER_MAX_WORKERS="60", **POOL_ENV
    )
    pool = {cid for cids in by_lease(sched).values() for cid in cids}

    responses = burst(sched, [{"owner_id": f"o{i}", "env": {"N": str(i)}} for i in range(50)])
    assert [r.status_code for r in responses] == [200] * 50, [
        r.text for r in responses if r.status_code != 200
    ][:3]
    leases = [r.json()["lease"] for r in responses]
    tokens = [lease["provider_token"] for lease in leases]
    assert len(set(tokens)) == 50 and len({lease["lease_id"] for lease in leases}) == 50
    # Every pool worker went to one caller (workers refilled during the burst may have
    # served some more warm); the rest were made cold.
    assert pool <= set(tokens)
    # No worker handed twice: each one's hand-off names its own lease and caller.
    for i, lease in enumerate(leases):
        page = worker_page(lease["provider_token"])
        assert page["lease_id"] == lease["lease_id"]
        if lease["provider_token"] in pool:
            assert page["handoff"]["env"] == {"N": str(i)}
    for lease_id, containers in by_lease(sched).items():
        assert len(containers) == 1, lease_id
    wait_idle(sched, 10, timeout=120)
    assert len(sched.containers()) == 60  # the cap allowed them all; it holds


def test_kill_9_with_idle_and_claimed_pool_workers_leaks_nothing(make_scheduler: Make) -> None:
    sched = warm_renderers(
        make_scheduler,
        3,
        WARM_HANDOFF_TIMEOUT_SECONDS="60",
        RECONCILE_INTERVAL_SECONDS="1",
        **POOL_ENV,
    )
    engine = docker_client()
    # The demo worker holds a hand-off while /tmp/handoff-hold exists: the acquire stays
    # between its claim and its hand-off, as a crash would find it.
    pool = {c.id: c for c in sched.containers()}
    for container in pool.values():
        container.exec_run(["/bin/busybox", "touch", "/tmp/handoff-hold"])
    caller = threading.Thread(
        target=lambda: _quietly(sched.acquire, kind="renderer", owner_id="bob")
    )
    caller.start()
    [claimed] = wait_for(
        lambda: sched.http.get("/v1/leases", params={"state": "provisioning"}).json(),
        30,
        what="a claimed pool worker",
    )
    assert claimed["owner_id"] == "bob"
    claimed_container = by_lease(sched)[claimed["lease_id"]][0]
    sched.kill()
    caller.join(70)
    for container in pool.values():
        with contextlib.suppress(docker.errors.APIError):
            container.exec_run(["/bin/busybox", "rm", "-f", "/tmp/handoff-hold"])

    sched.start()
    # The claimed worker is destroyed, never handed out; its lease failed.
    wait_for(lambda: claimed_container not in ids(sched), 30, what="claimed worker destroyed")
    failed = sched.http.get(f"/v1/lease/{claimed['lease_id']}").json()
    assert failed["state"] == "failed"
    # The idle ones are adopted as they are, and the pool refilled to 3, not beyond.
    wait_idle(sched, 3)
    assert set(pool) - {claimed_container} <= ids(sched)
    assert len(sched.containers()) == 3
    lease = sched.lease(kind="renderer")
    assert lease["provider_token"] in set(pool) - {claimed_container}
    assert worker_page(lease["provider_token"])["lease_id"] == lease["lease_id"]
    assert (
        len(
            engine.containers.list(
                filters={"label": f"{LEASE_LABEL}={claimed['lease_id']}"}, all=True
            )
        )
        == 0
    )


@pytest.fixture
def gpu_proxy(gpu_engine: PrivateEngine) -> Iterator[DockerProxy]:
    """The GPU engine behind a proxy, which shows what the scheduler asks of it (`seen`).
    Asked for before `make_scheduler`, so that it outlives the schedulers' clean-up."""
    where = Path(tempfile.mkdtemp(prefix="oa-proxy-", dir="/tmp"))  # unix paths are short
    proxy = DockerProxy(where / "docker.sock", gpu_engine.sock).start()
    try:
        yield proxy
    finally:
        proxy.close()
        shutil.rmtree(where, ignore_errors=True)


def test_a_cold_gpu_acquire_gets_the_device_an_idle_pool_worker_held(
    gpu_engine: PrivateEngine,
    gpu_proxy: DockerProxy,
    make_scheduler: Make,
) -> None:
    sched = make_scheduler(
        engine=gpu_proxy.url, LOCAL_GPU_DEVICES="0", WARM_POOL="anim/entry=1", **POOL_ENV
    )
    wait_idle(sched, 1, kind="anim", gpu="entry")
    [pool_worker] = [c.id for c in sched.containers()]
    assert device_ids(gpu_engine.client, pool_worker) == ["0"]

    # A renderer is not what the pool keeps: cold, and the only device is the pool's.
    lease = sched.lease(kind="renderer", gpu="entry")
    assert lease["provider_token"] != pool_worker
    assert device_ids(gpu_engine.client, lease["provider_token"]) == ["0"]
    assert pool_worker not in ids(sched)
    assert (
        sched.metric("scheduler_leases_released_total", provider="local-docker", reason="recycled")
        == 1
    )
    # The pool cannot refill while the device is leased; once released, it does. Each
    # pass of the pool asks whether the engine can be used (a ping: nothing else pings
    # it while nobody scrapes or acquires), then finds the device taken: two more pings
    # are two more passes, and none of them made a container.
    since = len(gpu_proxy.seen)
    wait_for(
        lambda: sum(r.endswith("/_ping") for r in gpu_proxy.seen[since:]) >= 2,
        60,
        0.1,
        what="two more passes of the pool",
    )
    assert not [r for r in gpu_proxy.seen[since:] if "/containers/create" in r]
    assert idle(sched, kind="anim", gpu="entry") == 0
    assert sched.release(lease["lease_id"]).status_code == 204
    wait_idle(sched, 1, kind="anim", gpu="entry")


def test_two_replicas_share_one_pool(replicas: Replicas) -> None:  # noqa: F811
    a, b = replicas(WARM_POOL="renderer/none=3", **POOL_ENV)
    wait_for(lambda: idle(a) == 3 or idle(b) == 3, 60, 0.1, what="3 idle")

    # Both keep filling; neither takes the pool past 3: watched until each replica has
    # ended a pass that found it full (scheduler_pool_idle is set at the end of each
    # pass); from then on a pass has nothing to make.
    def both_found_it_full() -> bool:
        assert len(a.containers()) <= 3
        return idle(a) == 3 and idle(b) == 3

    wait_for(both_found_it_full, 60, 0.2, what="both replicas to find the pool full")
    assert len(a.containers()) == 3
    pool = ids(a)

    got: list[dict[str, Any]] = []
    lock = threading.Lock()

    def take(s: Scheduler) -> None:
        lease = s.lease(kind="renderer")
        with lock:
            got.append(lease)

    threads = [threading.Thread(target=take, args=(s,)) for s in (a, b, a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    tokens = [lease["provider_token"] for lease in got]
    assert len(tokens) == 4 and len(set(tokens)) == 4
    assert len(pool & set(tokens)) >= 3  # the three pool workers, one caller each
    wait_for(lambda: idle(a) == 3 and idle(b) == 3, 60, 0.1, what="refilled")
    assert len(a.containers()) == 7


def test_warm_pool_alone_gets_a_working_pool_from_the_demo_worker(
    make_scheduler: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A newcomer's setting: WARM_POOL and nothing else (no hand-off path, no readiness
    # path), so the scheduler POSTs to its default WARM_HANDOFF_PATH, /openalice/lease.
    monkeypatch.delenv("WARM_HANDOFF_PATH", raising=False)
    sched = make_scheduler(WARM_POOL="renderer/none=1")
    assert not [name for name in sched.env if name.startswith("WARM_") and name != "WARM_POOL"]
    wait_idle(sched, 1)
    [pool_worker] = list(ids(sched))
    lease = sched.lease(kind="renderer", owner_id="newcomer", env={"SCENE": "intro"})
    assert lease["provider_token"] == pool_worker  # served warm
    page = worker_page(pool_worker)
    assert page["lease_id"] == lease["lease_id"] and page["fence"] == lease["fence"]
    assert page["handoff"] == {
        "lease_id": lease["lease_id"],
        "kind": "renderer",
        "expires_at": lease["expires_at"],
        "fence": lease["fence"],
        "env": {"SCENE": "intro"},
    }
    # The page over HTTP is the same: the worker's front passes other paths to httpd.
    networks = docker_client().api.inspect_container(pool_worker)["NetworkSettings"]
    [address] = [net["IPAddress"] for net in networks["Networks"].values()]
    assert HTTP.get(f"http://{address}:8080/", timeout=10).json() == page
    assert "switched off" not in sched.log()
    wait_idle(sched, 1, timeout=30)  # and the pool refills


def test_an_image_without_the_hand_off_is_not_used_warm(make_scheduler: Make) -> None:
    # A path the demo image has no script for: /openalice/<name> answers 404 there.
    sched = warm_renderers(
        make_scheduler,
        1,
        RENDERER_READY_PATH="/healthz",
        WARM_HANDOFF_PATH="/openalice/no-such-hand-off",
    )
    [pool_worker] = list(ids(sched))
    first = sched.lease(kind="renderer")
    assert first["provider_token"] != pool_worker  # went cold
    assert pool_worker not in ids(sched)
    second = sched.lease(kind="renderer")
    assert second["provider_token"] != pool_worker
    # sleep: a pool pass (one each 2 s) that skips a switched-off kind shows nowhere: no
    # Docker call, no store write, no log line, no metric change. Waited for in time,
    # then: it is not refilled.
    time.sleep(3)
    assert idle(sched) == 0 and len(sched.containers()) == 2
    assert sched.log().count("the renderer pool is switched off") == 1


@pytest.mark.parametrize(
    "value, problem",
    [
        ("renderer=2", "'renderer=2' is not kind/gpu[@class…]=N"),
        ("render/none=1", "unknown kind 'render'"),
        ("renderer/none=1,renderer/none=2", "renderer/none is given twice"),
        ("renderer/entry=min:0,buffer:1", "has no max"),
        ("renderer/none=min:3,max:1", "min 3 is above max 1"),
        ("renderer/none=min:0,max:2,spare:1", "'spare:1' in"),
        ("renderer/entry@vip=1", "the pool renderer/entry serves 'vip', which is not a class"),
    ],
)
def test_a_bad_warm_pool_stops_start_up(make_scheduler: Make, value: str, problem: str) -> None:
    sched = make_scheduler(start=False, WARM_POOL=value)
    with pytest.raises(AssertionError, match="exited"):
        sched.start()
    assert "WARM_POOL" in sched.log() and problem in sched.log()


def _quietly(call: Callable[..., Any], **body: Any) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the scheduler was killed under it
        call(**body)
