"""Readiness (issue 15, items 1-3): a lease is answered only once its worker answers.

- Docker: a worker whose health path answers after READY_DELAY_SECONDS holds the lease
  back that long, and its endpoint answers once granted; one that never answers (health
  path, or TCP port) is destroyed and the acquire is a 502 naming "not ready after";
- RunPod (the emulator's proxy, on REST and GraphQL): the same gating on the pod's proxy
  URL; a pod that never answers is terminated; a Docker worker that never gets ready
  fails over to RunPod;
- time to ready is a histogram per provider;
- the demo worker image is rebuilt when it was built from another entry script."""

from __future__ import annotations

import contextlib
import http.server
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import docker
import pytest

from openalice_scheduler.models import GpuClass, WorkerKind
from openalice_scheduler.providers.base import Worker, WorkerSpec
from openalice_scheduler.providers.probe import NotReady, ReadyProbe
from tests.harness import HTTP, REPO, Scheduler, docker_client, fetch_in_network
from tests.runpod_emulator import RunPodEmulator

KEY = "rpk-ready-" + uuid.uuid4().hex
Make = Callable[..., Scheduler]


def _time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _failed_leases(sched: Scheduler) -> list[dict[str, object]]:
    response = sched.http.get("/v1/leases", params={"state": "failed"})
    assert response.status_code == 200, response.text
    return list(response.json())


# --- Docker ---------------------------------------------------------------------------


def test_a_docker_lease_is_held_back_until_its_worker_answers(make_scheduler: Make) -> None:
    sched = make_scheduler(RENDERER_READY_PATH="/healthz")
    started = time.monotonic()
    lease = sched.lease(kind="renderer", ttl_seconds=300, env={"READY_DELAY_SECONDS": "2"})
    took = time.monotonic() - started
    assert took >= 2, f"answered after {took:.2f} s, before the worker was ready"

    # Granted: its endpoint answers, health path included, to a caller in the network.
    network = sched.env["DOCKER_NETWORK"]
    assert fetch_in_network(network, lease["endpoint"] + "/healthz").strip() == "ok"
    assert json.loads(fetch_in_network(network, lease["endpoint"]))["lease_id"] == lease["lease_id"]
    # The TTL counts from the acquire: lease and worker agree on expires_at.
    assert _time(lease["expires_at"]) - _time(lease["created_at"]) == timedelta(seconds=300)
    [container] = sched.containers()
    assert f"LEASE_EXPIRES_AT={lease['expires_at']}" in container.attrs["Config"]["Env"]

    assert sched.metric("scheduler_ready_seconds_count", provider="local-docker") == 1
    assert sched.metric("scheduler_ready_seconds_sum", provider="local-docker") >= 2
    assert f"lease {lease['lease_id']}: worker on local-docker ready " in sched.log()


def test_a_docker_worker_that_never_answers_is_destroyed(make_scheduler: Make) -> None:
    # 3 s: its health path answers 404 at least once in them on a loaded machine too.
    sched = make_scheduler(RENDERER_READY_PATH="/healthz", LOCAL_DOCKER_READY_TIMEOUT_SECONDS="3")
    response = sched.acquire(kind="renderer", env={"READY_DELAY_SECONDS": "never"})
    assert response.status_code == 502, response.text
    body = response.json()
    assert body["error"] == "provision_failed"
    assert "not ready after 3 s" in body["message"]
    assert "/healthz: 404" in body["failures"]["local-docker"]
    assert sched.containers() == []
    [failed] = _failed_leases(sched)
    assert failed["kind"] == "renderer"
    assert sched.leases() == []
    assert sched.metric("scheduler_ready_seconds_count", provider="local-docker") == 0


async def test_a_worker_that_answered_is_named_by_its_answer_not_by_the_attempt_cut_short() -> None:
    """A health path that answered 404, then, its worker loaded, nothing before the probe's
    time ran out: the caller is told the 404 the worker gave, not the timeout of the last
    attempt, which the probe's own deadline cut short (seen on a loaded machine)."""
    answered = 0
    hold = threading.Event()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            nonlocal answered
            if answered < 2:
                answered += 1
                self.send_error(404)
            else:
                hold.wait(10)  # a worker too busy to answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    probe = ReadyProbe({"renderer": "/healthz"}, {"local-docker": 1.0})
    url = f"http://127.0.0.1:{server.server_address[1]}"
    spec = WorkerSpec(
        lease_id=str(uuid.uuid4()),
        kind=WorkerKind.renderer,
        gpu=GpuClass.none,
        expires_at=datetime.now(UTC) + timedelta(minutes=5),
    )
    try:
        with pytest.raises(NotReady) as failed:
            await probe.wait("local-docker", spec, Worker(url, "token"), time.perf_counter())
    finally:
        hold.set()
        await probe.close()
        server.shutdown()
        server.server_close()
    assert answered == 2
    assert str(failed.value) == f"worker not ready after 1 s (GET {url}/healthz: 404)"


def test_without_a_ready_path_the_probe_is_a_tcp_connect(make_scheduler: Make) -> None:
    sched = make_scheduler(LOCAL_DOCKER_READY_TIMEOUT_SECONDS="1")
    # The worker listens on 9999, not on RENDERER_PORT (8080): it never gets ready.
    response = sched.acquire(kind="renderer", env={"PORT": "9999"})
    assert response.status_code == 502, response.text
    message = response.json()["message"]
    assert "not ready after 1 s" in message and ":8080: " in message
    assert sched.containers() == []
    # A worker listening where it should is ready at once.
    lease = sched.lease(kind="renderer")
    assert [c.id for c in sched.containers()] == [lease["provider_token"]]
    assert sched.metric("scheduler_ready_seconds_count", provider="local-docker") == 1


# --- RunPod ---------------------------------------------------------------------------


@pytest.fixture
def runpod(runpod_server: RunPodEmulator) -> RunPodEmulator:
    runpod_server.reset()
    runpod_server.provision_delay = 0.3
    return runpod_server


def _on_runpod(make_scheduler: Make, runpod: RunPodEmulator, api: str, **env: str) -> Scheduler:
    return make_scheduler(
        **{
            "PROVIDERS": "runpod",
            "RUNPOD_API": api,
            "RUNPOD_API_KEY": KEY,
            "RUNPOD_API_BASE_URL": runpod.base_url,
            "RUNPOD_PROXY_URL": runpod.proxy_url,
            "RUNPOD_POLL_INTERVAL_SECONDS": "0.1",
            "RUNPOD_CATALOG_TTL_SECONDS": "0",
            **env,
        }
    )


def test_a_runpod_lease_is_held_back_until_its_proxy_url_answers(
    api: str, make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    runpod.pods_answer_after = 1.5  # the pod listens 1.5 s after RunPod calls it RUNNING
    sched = _on_runpod(
        make_scheduler, runpod, api, ANIM_READY_PATH="/healthz", RUNPOD_READY_TIMEOUT_SECONDS="30"
    )
    started = time.monotonic()
    lease = sched.lease(kind="anim", gpu="mid", ttl_seconds=600)
    took = time.monotonic() - started
    assert took >= 1.8, f"answered after {took:.2f} s, before the pod answered"

    [pod] = runpod.list_pods()
    assert lease["endpoint"] == runpod.proxy_url.format(pod_id=pod.id, port=8080)
    answer = HTTP.get(lease["endpoint"] + "/healthz", timeout=10)
    assert answer.status_code == 200 and answer.json()["pod_id"] == pod.id
    assert runpod.proxy_hits(pod.id) > 2  # probed, refused, probed again
    assert pod.env["LEASE_EXPIRES_AT"] == lease["expires_at"]
    assert sched.metric("scheduler_ready_seconds_count", provider="runpod") == 1
    assert sched.metric("scheduler_ready_seconds_sum", provider="runpod") >= 1.8
    assert KEY not in sched.log()


def test_a_pod_that_never_answers_is_terminated(
    api: str, make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    sched = _on_runpod(make_scheduler, runpod, api, RUNPOD_READY_TIMEOUT_SECONDS="1.5")
    response = sched.acquire(kind="anim", gpu="mid")
    assert response.status_code == 502, response.text
    message = response.json()["message"]
    assert "not ready after 1.5 s" in message and ": 502" in message
    assert runpod.call_count("create") == 1
    assert runpod.list_pods() == []
    assert len(_failed_leases(sched)) == 1


def test_a_docker_worker_never_ready_fails_over_to_runpod(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    runpod.pods_answer_after = 0
    sched = _on_runpod(
        make_scheduler,
        runpod,
        "rest",
        PROVIDERS="local-docker,runpod",
        LOCAL_DOCKER_READY_TIMEOUT_SECONDS="1",
        RUNPOD_READY_TIMEOUT_SECONDS="30",
    )
    # Docker's worker listens on 9999, not 8080: never ready; the pod answers at once.
    response = sched.acquire(kind="renderer", gpu="none", env={"PORT": "9999"})
    assert response.status_code == 200, response.text
    assert response.json()["provider"] == "runpod"
    assert sched.containers() == []  # the Docker worker was destroyed
    assert len(runpod.list_pods()) == 1
    assert "local-docker failed to provision: worker not ready after 1 s" in sched.log()


# --- the demo worker image ------------------------------------------------------------


def test_the_worker_image_is_rebuilt_when_its_entry_script_changed() -> None:
    image = f"openalice-ready-test:{uuid.uuid4().hex[:8]}"
    client = docker_client()
    # An image of the same name from before the entry script changed (no label).
    stale = (
        subprocess.run(
            ["docker", "import", "-", image], input=_empty_tar(), check=True, capture_output=True
        )
        .stdout.decode()
        .strip()
    )
    script = str(REPO / "scripts" / "build-worker-image.sh")
    try:
        first = subprocess.run([script, image], capture_output=True, text=True, check=True)
        assert "rebuilding" in first.stderr and "built" in first.stderr
        built = client.images.get(image)
        assert built.labels.get("openalice.worker.entry")
        second = subprocess.run([script, image], capture_output=True, text=True, check=True)
        assert "already present" in second.stderr
        assert client.images.get(image).id == built.id  # kept, not built again
        out = client.containers.run(image, ["/bin/busybox", "cat", "/entry.sh"], remove=True)
        assert b"READY_DELAY_SECONDS" in out
    finally:
        for name in (image, stale):  # the stale one is left untagged by the rebuild
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(name, force=True)


def _empty_tar() -> bytes:
    return subprocess.run(["tar", "-c", "-T", "/dev/null"], capture_output=True, check=True).stdout
