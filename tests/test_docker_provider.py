"""The local-docker provider as a caller sees it: the worker containers it makes, GPU
assignment, the worker cap, a missing image and regions. Real service, real Docker."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import docker
import httpx

from tests.engines import PrivateEngine
from tests.harness import (
    SECRET,
    TLS,
    Scheduler,
    docker_client,
    fetch_in_network,
    printed_in,
    wait_for,
)

LABEL = "openalice.scheduler."


def acquire_concurrently(sched: Scheduler, n: int, **body: Any) -> list[httpx.Response]:
    """`n` acquires sent at once from `n` threads, each on its own connection."""
    body.setdefault("kind", "renderer")
    barrier = threading.Barrier(n)

    def one(_: int) -> httpx.Response:
        with httpx.Client(
            verify=TLS, base_url=sched.url, headers={"X-Internal-Secret": SECRET}, timeout=120
        ) as client:
            barrier.wait(timeout=60)
            return client.post("/v1/lease", json=body)

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, range(n)))


def network_exists(name: str) -> bool:
    return any(n.name == name for n in docker_client().networks.list(names=[name]))


def device_ids(engine: docker.DockerClient, container_id: str) -> list[str]:
    attrs = engine.api.inspect_container(container_id)
    requests = attrs["HostConfig"]["DeviceRequests"] or []
    assert len(requests) == 1, requests
    return list(requests[0]["DeviceIDs"])


def fetch_worker(network: str, endpoint: str) -> dict[str, Any]:
    """The worker's answer from inside the network, once its HTTP server is up."""
    answer: dict[str, Any] = {}

    def answered() -> bool:
        try:
            answer.update(json.loads(fetch_in_network(network, endpoint)))
        except docker.errors.ContainerError:
            return False  # not listening yet
        return True

    wait_for(answered, timeout=60, interval=0.5, what=f"{endpoint} to answer in {network}")
    return answer


def test_worker_container_has_the_contract_name_labels_env_and_network(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    network = f"oa-net-{uuid.uuid4().hex[:10]}"
    assert not network_exists(network)
    sched = make_scheduler(DOCKER_NETWORK=network)

    lease = sched.lease(
        kind="anim",
        owner_id="anim-service",
        ttl_seconds=900,
        env={"SCENE": "intro", "QUALITY": "draft", "LEASE_ID": "forged"},
    )
    lease_id = lease["lease_id"]
    name = f"oa-anim-{uuid.UUID(lease_id).hex[:12]}"
    assert network_exists(network), "DOCKER_NETWORK is created when missing"

    [container] = sched.containers()
    attrs = docker_client().api.inspect_container(container.id)
    assert attrs["Name"] == f"/{name}"
    assert container.id == lease["provider_token"]
    assert attrs["State"]["Running"]
    labels = attrs["Config"]["Labels"]
    assert labels[LABEL + "lease_id"] == lease_id
    assert labels[LABEL + "kind"] == "anim"
    assert labels[LABEL + "owner"] == "anim-service"
    assert labels[LABEL + "instance"] == sched.instance
    env = dict(item.split("=", 1) for item in attrs["Config"]["Env"])
    assert env["SCENE"] == "intro" and env["QUALITY"] == "draft"
    assert env["LEASE_ID"] == lease_id  # the scheduler's keys win over the caller's
    assert env["LEASE_EXPIRES_AT"] == lease["expires_at"]
    assert env["WORKER_KIND"] == "anim"
    assert list(attrs["NetworkSettings"]["Networks"]) == [network]
    assert not attrs["HostConfig"]["DeviceRequests"], "gpu=none gets no GPU"
    assert lease["endpoint"] == f"http://{name}:8080"

    answer = fetch_worker(network, lease["endpoint"])
    assert answer["lease_id"] == lease_id
    assert answer["kind"] == "anim"
    assert answer["expires_at"] == lease["expires_at"]

    # Without an owner there is no owner label.
    plain = sched.lease(kind="renderer")
    [other] = [c for c in sched.containers() if c.id == plain["provider_token"]]
    assert LABEL + "owner" not in other.labels
    assert other.labels[LABEL + "kind"] == "renderer"

    assert sched.release(lease_id, owner="anim-service").status_code == 204
    assert sched.release(plain["lease_id"]).status_code == 204
    assert sched.containers() == []


def test_entry_gpus_are_assigned_exclusively(
    gpu_engine: PrivateEngine, make_scheduler: Callable[..., Scheduler]
) -> None:
    sched = make_scheduler(engine=gpu_engine.url, LOCAL_GPU_DEVICES="0,1")
    engine = gpu_engine.client

    responses = acquire_concurrently(sched, 6, gpu="entry")
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(ok) == 2, [r.text for r in responses]
    for response in refused:
        assert response.status_code == 503, response.text
        body = response.json()
        assert body["error"] == "no_provider_available"
        assert "GPU" in body["message"], body

    leases = [r.json()["lease"] for r in ok]
    held = {lease["lease_id"]: device_ids(engine, lease["provider_token"]) for lease in leases}
    assert sorted(sum(held.values(), [])) == ["0", "1"], held
    assert all(lease["gpu"] == "entry" for lease in leases)
    assert len(sched.containers()) == 2
    # The worker itself is told which GPU it has.
    for lease in leases:
        container = engine.containers.get(lease["provider_token"])
        # The main process's environment (an exec'd process does not inherit it).
        out = printed_in(container, ["/bin/busybox", "cat", "/proc/1/environ"]).decode()
        visible = [v for v in out.split("\0") if v.startswith("NVIDIA_VISIBLE_DEVICES=")]
        assert visible == [f"NVIDIA_VISIBLE_DEVICES={held[lease['lease_id']][0]}"], out

    # Releasing one frees exactly its device for the next lease.
    first = leases[0]
    freed = held[first["lease_id"]]
    assert sched.release(first["lease_id"]).status_code == 204
    again = sched.lease(gpu="entry")
    assert device_ids(engine, again["provider_token"]) == freed
    full = sched.acquire(gpu="entry")
    assert full.status_code == 503, full.text
    assert len(sched.containers()) == 2


def test_entry_gpu_without_devices_and_mid_high_are_refused(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler()  # LOCAL_GPU_DEVICES="" : this host has no GPU
    response = sched.acquire(gpu="entry")
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["error"] == "no_provider_available"
    assert "LOCAL_GPU_DEVICES" in body["message"], body

    gpu_sched = make_scheduler(LOCAL_GPU_DEVICES="0")
    for gpu in ("mid", "high"):
        for s in (sched, gpu_sched):
            response = s.acquire(gpu=gpu)
            assert response.status_code == 503, response.text
            body = response.json()
            assert body["error"] == "no_provider_available"
            assert "local Docker" in body["message"], body
            assert f"gpu={gpu}" in body["message"], body
    assert sched.containers() == [] and gpu_sched.containers() == []
    assert sched.leases() == [] and gpu_sched.leases() == []


def test_worker_cap_holds_under_100_concurrent_acquires(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler(LOCAL_DOCKER_MAX_WORKERS="10")

    responses = acquire_concurrently(sched, 100)
    statuses = sorted(r.status_code for r in responses)
    ok = [r for r in responses if r.status_code == 200]
    assert len(ok) == 10, statuses
    for response in responses:
        if response.status_code == 200:
            continue
        assert response.status_code == 503, response.text
        body = response.json()
        assert body["error"] == "no_provider_available"
        assert "capacity" in body["message"], body

    running = sched.containers(all=False)
    assert len(running) == 10
    assert {c.id for c in running} == {r.json()["lease"]["provider_token"] for r in ok}
    assert len(sched.leases()) == 10
    assert sched.metric("scheduler_active_leases") == 10
    assert sched.metric("scheduler_acquire_failures_total", reason="no_provider") == 90

    # Capacity comes back when a lease goes.
    assert sched.release(ok[0].json()["lease"]["lease_id"]).status_code == 204
    assert sched.acquire().status_code == 200
    assert sched.acquire().status_code == 503


def test_missing_image_is_a_502_naming_it_and_leaves_nothing(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler(RENDERER_IMAGE="nonexistent-image:0")
    response = sched.acquire(kind="renderer")
    assert response.status_code == 502, response.text
    body = response.json()
    assert body["error"] == "provision_failed"
    assert "nonexistent-image:0" in body["message"], body
    assert "nonexistent-image:0" in body["failures"]["local-docker"], body
    assert sched.containers() == []
    assert sched.leases() == []
    assert sched.metric("scheduler_active_leases") == 0
    assert sched.metric("scheduler_acquire_failures_total", reason="provision_failed") == 1
    # The other kind's image is fine and still served.
    assert sched.lease(kind="anim")["kind"] == "anim"
    assert len(sched.containers()) == 1


def test_region_is_served_only_where_local_docker_is(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    nowhere = make_scheduler()
    response = nowhere.acquire(region="eu-west")
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["error"] == "no_provider_available"
    assert "eu-west" in body["message"], body
    assert nowhere.containers() == []
    # A request without region is still served.
    assert nowhere.acquire().status_code == 200

    placed = make_scheduler(LOCAL_DOCKER_REGION="eu-west")
    lease = placed.lease(region="eu-west")
    assert lease["region"] == "eu-west"
    assert [c.id for c in placed.containers()] == [lease["provider_token"]]
    elsewhere = placed.acquire(region="us-east")
    assert elsewhere.status_code == 503, elsewhere.text
    assert "us-east" in elsewhere.json()["message"]


def test_a_network_made_twice_by_replicas_is_healed(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """Replicas sharing DOCKER_NETWORK can create it at the same moment (the engine checks
    duplicates without a lock). Containers then cannot start on the name ("ambiguous"), or
    land on a copy another replica removes. The scheduler keeps the first one made."""
    network = f"oa-dup-{uuid.uuid4().hex[:10]}"
    client = docker_client()
    first = client.networks.create(network, driver="bridge", check_duplicate=False)
    second = client.networks.create(network, driver="bridge", check_duplicate=False)
    try:
        assert first.id != second.id
        sched = make_scheduler(DOCKER_NETWORK=network)
        lease = sched.lease()
        remaining = [n.id for n in client.networks.list(names=[network]) if n.name == network]
        assert remaining == [first.id]
        attached = client.api.inspect_container(lease["provider_token"])
        assert list(attached["NetworkSettings"]["Networks"]) == [network]
        assert attached["NetworkSettings"]["Networks"][network]["NetworkID"] == first.id
        assert sched.release(lease["lease_id"]).status_code == 204
    finally:
        for net in (first, second):
            with contextlib.suppress(docker.errors.APIError):
                net.remove()
