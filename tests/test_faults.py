"""Faults with real processes: the scheduler killed with SIGKILL mid-provision and
mid-release, a Docker engine stopped for real, a Docker engine unreachable (through the
fault-injecting proxy in tests/dockerproxy.py). Each test asserts what a caller of the
service would notice: leases that survive a crash unchanged, errors that name Docker,
workers that are destroyed without anyone asking twice, and no leaked containers."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dockerproxy import DockerProxy
from tests.engines import Engine, PrivateEngine
from tests.harness import HTTP, SECRET, TLS, Scheduler, wait_for

LEASE_LABEL = "openalice.scheduler.lease_id"
START = r"^POST /v[\d.]+/containers/[^/?]+/start(\?|$)"
REMOVE = r"^DELETE /v[\d.]+/containers/[^/?]+(\?|$)"


# --- helpers ---------------------------------------------------------------------------


@pytest.fixture
def proxy() -> Iterator[DockerProxy]:
    """A fault-injecting proxy in front of the shared engine."""
    with _proxy_to("/var/run/docker.sock") as p:
        yield p


@pytest.fixture
def gpu_proxy(gpu_engine: PrivateEngine) -> Iterator[DockerProxy]:
    """A fault-injecting proxy in front of the engine that accepts GPU device requests."""
    with _proxy_to(gpu_engine.sock) as p:
        yield p


@contextlib.contextmanager
def _proxy_to(upstream: str) -> Iterator[DockerProxy]:
    # On a short socket path: unix socket paths are limited to 107 bytes.
    where = Path(tempfile.mkdtemp(prefix="oa-proxy-", dir="/tmp"))
    p = DockerProxy(where / "docker.sock", upstream).start()
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(where, ignore_errors=True)


def db_state(s: Scheduler, lease_id: str) -> str | None:
    """The lease's state as recorded in the scheduler's SQLite file, read-only."""
    path = s.env["DATABASE_URL"].removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
        row = db.execute("SELECT state FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
    return row[0] if row else None


def lease_ids_of(containers: list[Any]) -> list[str]:
    return sorted(c.labels[LEASE_LABEL] for c in containers)


def released(s: Scheduler, reason: str) -> float:
    return s.metric("scheduler_leases_released_total", provider="local-docker", reason=reason)


def in_thread(fn: Callable[[], httpx.Response]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run one HTTP call in a thread; the outcome dict gets `response` or `error`."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["response"] = fn()
        except httpx.HTTPError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def own_client(s: Scheduler) -> httpx.Client:
    """A client of its own, for calls made from a second thread."""
    return httpx.Client(
        verify=TLS, base_url=s.url, headers={"X-Internal-Secret": SECRET}, timeout=120
    )


def assert_names_docker(response: httpx.Response, statuses: tuple[int, ...]) -> dict[str, Any]:
    assert response.status_code in statuses, response.text
    body = response.json()
    assert "docker" in body["message"].lower(), body
    return body


# --- a Docker engine we may stop for real ----------------------------------------------


@pytest.fixture
def private_engine() -> Iterator[PrivateEngine]:
    """A Docker engine for this test alone: stopping the shared engine
    (/var/run/docker.pid) would stop every container of every other test running on
    this machine at the same time."""
    with PrivateEngine() as engine:
        yield engine


# --- kill -9 mid-provision ---------------------------------------------------------------


@pytest.mark.timeout(300)
def test_kill_9_mid_provision_keeps_leases_and_leaks_nothing(
    gpu_engine: PrivateEngine, gpu_proxy: DockerProxy, make_scheduler: Callable[..., Scheduler]
) -> None:
    s = make_scheduler(engine=gpu_engine.url, DOCKER_HOST=gpu_proxy.url, LOCAL_GPU_DEVICES="0")
    bodies: list[dict[str, Any]] = [
        {"kind": "renderer", "correlation_id": "job-1", "ttl_seconds": 3600},
        {"kind": "anim", "owner_id": "anim-service", "ttl_seconds": 7200},
        {"kind": "renderer", "gpu": "entry", "correlation_id": "gpu-job", "ttl_seconds": 1800},
        {"kind": "anim", "env": {"SCENE": "intro"}, "ttl_seconds": 28800},
        {"kind": "renderer", "owner_id": "live-control", "correlation_id": "c" * 128},
    ]
    acquired = [s.lease(**body) for body in bodies]
    before = s.leases()
    assert sorted(before, key=lambda x: x["lease_id"]) == sorted(
        acquired, key=lambda x: x["lease_id"]
    )
    ids = sorted(lease["lease_id"] for lease in acquired)
    assert lease_ids_of(s.containers()) == ids

    # The 6th acquire: its container gets created, its start is held by the proxy.
    gpu_proxy.delay(START, 30)
    with own_client(s) as client:
        thread, outcome = in_thread(
            lambda: client.post("/v1/lease", json={"kind": "anim", "correlation_id": "doomed"})
        )
        gpu_proxy.wait_held(1, timeout=60)
        extra = wait_for(
            lambda: [c for c in s.containers() if c.labels[LEASE_LABEL] not in ids],
            60,
            what="the 6th container",
        )
        assert len(extra) == 1
        doomed = extra[0].labels[LEASE_LABEL]
        assert db_state(s, doomed) == "provisioning"

        s.kill()
        gpu_proxy.clear()
        thread.join(60)
    assert not thread.is_alive()
    # The caller of the 6th acquire never got a lease: the connection died under it.
    assert "response" not in outcome, outcome["response"].text
    assert isinstance(outcome["error"], httpx.TransportError)
    gpu_proxy.wait_held(0, timeout=30)  # the held start was dropped, never forwarded

    s.start()

    # The five leases are there, field for field; the 6th is not.
    assert s.leases() == before
    assert db_state(s, doomed) in ("failed", None)
    # Its container is gone; every container of this instance belongs to a live lease.
    wait_for(
        lambda: lease_ids_of(s.containers()) == ids, 60, what="only the five leases' containers"
    )
    assert all(c.status == "running" for c in s.containers())
    assert released(s, "failed") == 1
    gone = s.release(doomed)
    assert gone.status_code == 404, gone.text

    # The GPU is still taken by the lease that held it before the crash.
    taken = s.acquire(kind="renderer", gpu="entry")
    assert taken.status_code == 503, taken.text
    assert "GPU" in taken.json()["message"]

    # Each surviving lease still works: released by its owner, its worker destroyed.
    for lease in acquired:
        response = s.release(lease["lease_id"], owner=lease["owner_id"])
        assert response.status_code == 204, response.text
    assert s.leases() == []
    assert s.containers() == []


# --- kill -9 mid-release -----------------------------------------------------------------


@pytest.mark.timeout(300)
def test_kill_9_mid_release_the_worker_is_still_destroyed(
    proxy: DockerProxy, make_scheduler: Callable[..., Scheduler]
) -> None:
    """Two releases in flight when the service dies. The restarted service finishes
    both before it answers (a lone SQLite store's release claims belong to the dead
    process), so nobody has to call again; a caller who does retries gets 404."""
    s = make_scheduler(DOCKER_HOST=proxy.url, SWEEP_INTERVAL_SECONDS="1")
    keep = s.lease(kind="renderer", correlation_id="keep")
    retried = s.lease(kind="anim", owner_id="anim-service")
    forgotten = s.lease(kind="renderer")

    proxy.delay(REMOVE, 30)
    with own_client(s) as a, own_client(s) as b:
        calls = [
            in_thread(
                lambda: a.delete(
                    f"/v1/lease/{retried['lease_id']}", headers={"X-Lease-Owner": "anim-service"}
                )
            ),
            in_thread(lambda: b.delete(f"/v1/lease/{forgotten['lease_id']}")),
        ]
        proxy.wait_held(2, timeout=60)
        s.kill()
        proxy.clear()
        for thread, _ in calls:
            thread.join(60)
    for thread, outcome in calls:
        assert not thread.is_alive()
        assert isinstance(outcome.get("error"), httpx.TransportError), outcome
    proxy.wait_held(0, timeout=30)
    assert len(s.containers()) == 3  # nothing was destroyed before the crash

    s.start()
    assert s.leases() == [keep]
    # Both workers were destroyed during start-up, before the service answered.
    assert lease_ids_of(s.containers()) == [keep["lease_id"]]
    assert db_state(s, forgotten["lease_id"]) == "released"
    assert db_state(s, retried["lease_id"]) == "released"
    assert s.metric("scheduler_leases_releasing") == 0
    response = s.release(retried["lease_id"], owner="anim-service")
    assert response.status_code == 404, response.text
    assert s.release(forgotten["lease_id"]).status_code == 404
    assert s.leases() == [keep]


# --- the Docker engine stopped for real --------------------------------------------------


@pytest.mark.timeout(420)
def test_docker_engine_stopped_and_restarted(
    private_engine: PrivateEngine, make_scheduler: Callable[..., Scheduler]
) -> None:
    s = make_scheduler(
        DOCKER_HOST=private_engine.url, SWEEP_INTERVAL_SECONDS="1", RECONCILE_INTERVAL_SECONDS="1"
    )
    keep = s.lease(kind="anim", correlation_id="keep")
    lease = s.lease(kind="renderer", correlation_id="to-release")
    assert lease_ids_of(private_engine.containers(s.instance)) == sorted(
        [keep["lease_id"], lease["lease_id"]]
    )

    # Stop the engine the way an operator would: SIGTERM to the pid in its pid file.
    engine = Engine.capture(
        private_engine.running_pid(),
        private_engine.sock,
        private_engine.root / "dockerd.log",
        own_netns=True,
        route=private_engine.route,
    )
    assert engine.argv == private_engine.engine.argv  # type: ignore[union-attr]
    assert engine.env == private_engine.engine.env  # type: ignore[union-attr]
    try:
        engine.stop()  # dockerd stops its containers first: the workers die with it
        assert not engine.answers()

        health = HTTP.get(f"{s.url}/health", timeout=30)
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "service": "openalice-scheduler"}

        assert_names_docker(s.acquire(kind="renderer"), (502, 503))

    finally:
        if not engine.answers():
            engine.start()  # same argv and environment, a session of its own
        private_engine.adopt(engine)
    assert engine.answers()

    # A lease means a worker: both end `lost`, as their containers `exited` (heard from
    # the engine's events as it stopped them, or from its listing now it is back), and
    # a release of one finds it ended.
    def both_lost() -> bool:
        return all(
            (now := s.http.get(f"/v1/lease/{held['lease_id']}").json())["state"] == "released"
            and (now["release_reason"], now["lost_cause"]) == ("lost", "exited")
            for held in (keep, lease)
        )

    wait_for(both_lost, 90, interval=0.5, what="both leases lost")
    assert s.release(lease["lease_id"]).status_code == 404
    assert s.leases() == []

    # Back: what remains of the dead workers is removed (their containers, orphans
    # now), and the service serves again, with the same engine.
    wait_for(
        lambda: private_engine.containers(s.instance) == [],
        90,
        interval=0.5,
        what="the dead workers' containers removed",
    )
    fresh = wait_for(
        lambda: s.acquire(kind="renderer").json().get("lease"), 60, interval=0.5, what="served"
    )
    assert s.release(fresh["lease_id"]).status_code == 204
    assert private_engine.containers(s.instance) == []
    assert released(s, "lost") == 2 and released(s, "explicit") == 1


# --- the Docker engine unreachable (proxy stopped) ---------------------------------------


@pytest.mark.timeout(240)
def test_docker_unreachable_then_back(
    proxy: DockerProxy, make_scheduler: Callable[..., Scheduler]
) -> None:
    s = make_scheduler(DOCKER_HOST=proxy.url, SWEEP_INTERVAL_SECONDS="1")
    keep = s.lease(kind="anim")
    lease = s.lease(kind="renderer")
    proxy.stop()
    try:
        assert HTTP.get(f"{s.url}/health", timeout=30).status_code == 200
        failed = assert_names_docker(s.acquire(kind="renderer"), (502, 503))
        assert failed["error"] in ("no_provider_available", "provision_failed")
        body = assert_names_docker(s.release(lease["lease_id"]), (502,))
        assert body["error"] == "release_failed"
        assert s.metric("scheduler_leases_releasing") == 1
        assert db_state(s, lease["lease_id"]) == "releasing"
        # The worker is still there (the engine is fine; only the way to it is cut).
        assert lease_ids_of(s.containers()) == sorted([keep["lease_id"], lease["lease_id"]])
        wait_for(
            lambda: s.metric("scheduler_release_failures_total", provider="local-docker") >= 2,
            60,
            interval=0.2,
            what="a background retry",
        )
        assert s.leases() == [keep]
    finally:
        proxy.start()

    wait_for(
        lambda: lease_ids_of(s.containers()) == [keep["lease_id"]],
        90,
        interval=0.5,
        what="the worker to be destroyed",
    )
    wait_for(lambda: s.metric("scheduler_leases_releasing") == 0, 30)
    assert released(s, "explicit") == 1
    assert db_state(s, lease["lease_id"]) == "released"
    assert s.leases() == [keep]
    fresh = s.lease(kind="renderer")
    for item in (fresh, keep):
        assert s.release(item["lease_id"]).status_code == 204
    assert s.containers() == []


@pytest.mark.timeout(240)
def test_service_starts_while_docker_is_unreachable(
    proxy: DockerProxy, make_scheduler: Callable[..., Scheduler]
) -> None:
    proxy.stop()
    s = make_scheduler(DOCKER_HOST=proxy.url)  # waits for /health
    response = s.acquire(kind="renderer")
    body = assert_names_docker(response, (503,))
    assert body["error"] == "no_provider_available"
    assert "local-docker" in body["reasons"]
    assert s.leases() == []

    proxy.start()
    lease = wait_for(
        lambda: (r := s.acquire(kind="renderer")).status_code == 200 and r,
        30,
        interval=0.5,
        what="an acquire to succeed",
    ).json()["lease"]
    assert s.leases() == [lease]
    assert lease_ids_of(s.containers()) == [lease["lease_id"]]
    assert s.release(lease["lease_id"]).status_code == 204
    assert s.containers() == []
