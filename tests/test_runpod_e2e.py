"""End to end: the scheduler as a separate process over HTTP, with local Docker and RunPod
(the emulator, over real HTTP on loopback) as its providers.

- gpu=none goes to Docker, gpu=mid to RunPod; release destroys the pod;
- with every mid candidate out of capacity, acquire answers 503 naming RunPod's reason,
  also when the catalog showed stock and only the creates were refused (and on GraphQL,
  which has no catalog); real failures stay 502;
- with the Docker engine stopped, gpu=none fails over to a RunPod CPU pod;
- kill -9 just after a create was sent leaves exactly one pod, destroyed by reconciliation
  after the restart; an active lease's pod is kept (adopted) across a kill -9;
- vanished pods mark their lease lost; duplicates and orphans are destroyed;
- the RunPod key never appears in the log, an HTTP answer, a metric or a span."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dockerproxy import DockerProxy
from tests.harness import HTTP, Scheduler, wait_for
from tests.otlp_receiver import OtlpReceiver
from tests.runpod_emulator import NO_CAPACITY_MESSAGE, RunPodEmulator
from tests.test_lifecycle import passes

KEY = "rpk-e2e-" + uuid.uuid4().hex
MID = ["NVIDIA L40S", "NVIDIA RTX 6000 Ada Generation", "NVIDIA RTX A6000"]
# Everything the service can log, at its most talkative, to show the key is in none of it.
VERBOSE = "debug,httpx=debug,httpcore=debug"


@pytest.fixture
def start(on_runpod: Callable[..., Scheduler]) -> Iterator[Callable[..., Scheduler]]:
    """Start a scheduler with both providers, RunPod pointed at the emulator. At the end of
    the test, the key must be in none of their logs."""
    started: list[tuple[Scheduler, str]] = []

    def make(api: str = "rest", *, key: str = KEY, **env: str) -> Scheduler:
        both = {"PROVIDERS": "local-docker,runpod", "RUST_LOG": VERBOSE}
        sched = on_runpod(api, key=key, **(both | env))
        started.append((sched, key))
        return sched

    yield make
    for sched, key in started:
        assert key not in sched.log(), f"RUNPOD_API_KEY in the log of {sched.instance}"


def make_pod(runpod: RunPodEmulator, name: str) -> str:
    """A pod made behind the scheduler's back, over the emulator's REST API."""
    response = HTTP.post(
        f"{runpod.base_url}/v2/pods",
        headers=runpod.auth_headers,
        json={
            "name": name,
            "image": "x",
            "gpu": {"id": MID[0], "count": 1},
            "ports": ["8080/http"],
        },
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def test_gpu_none_goes_to_docker_and_mid_to_runpod(
    api: str, start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    sched = start(api)
    local = sched.acquire(kind="renderer", gpu="none")
    assert local.status_code == 200, local.text
    assert local.json()["provider"] == "local-docker"
    assert runpod.call_count("create") == 0

    response = sched.acquire(
        kind="anim", gpu="mid", correlation_id="rp-1", env={"SCENE": "intro"}, ttl_seconds=600
    )
    assert response.status_code == 200, response.text
    body = response.json()
    lease = body["lease"]
    assert body["provider"] == "runpod" == lease["provider"]
    [pod] = runpod.list_pods()
    assert lease["provider_token"] == pod.id and lease["gpu"] == "mid"
    assert lease["endpoint"] == f"https://{pod.id}-8080.proxy.runpod.net"
    assert pod.name == f"oa-{sched.instance}-{lease['lease_id']}"
    assert pod.gpu_id in MID and pod.status == "RUNNING"
    assert pod.env["LEASE_ID"] == lease["lease_id"]
    assert pod.env["LEASE_EXPIRES_AT"] == lease["expires_at"]
    assert pod.env["WORKER_KIND"] == "anim" and pod.env["SCENE"] == "intro"
    assert pod.env["OPENALICE_SCHEDULER_INSTANCE"] == sched.instance
    assert {item["lease_id"] for item in sched.leases()} == {
        lease["lease_id"],
        local.json()["lease"]["lease_id"],
    }
    assert (
        sched.metric("scheduler_leases_acquired_total", provider="runpod", kind="anim", gpu="mid")
        == 1
    )

    assert sched.release(lease["lease_id"]).status_code == 204
    assert runpod.list_pods() == []
    assert sched.release(lease["lease_id"]).status_code == 404
    assert sched.release(local.json()["lease"]["lease_id"]).status_code == 204
    assert (
        sched.metric("scheduler_leases_released_total", provider="runpod", reason="explicit") == 1
    )


def test_mid_out_of_capacity_is_503_naming_runpods_reason(
    start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    sched = start("rest")
    for gpu in MID:
        runpod.set_no_capacity(gpu)
    response = sched.acquire(kind="renderer", gpu="mid")
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["error"] == "no_provider_available"
    reason = body["reasons"]["runpod"]
    assert "no stock" in reason and all(gpu in reason for gpu in MID)
    assert "runpod" in body["message"] and "no stock" in body["message"]
    assert "local-docker" in body["reasons"]
    assert runpod.call_count("create") == 0 and runpod.list_pods() == []

    runpod.set_no_capacity(MID[1], False)  # stock is back: served at once (TTL 0)
    response = sched.acquire(kind="renderer", gpu="mid")
    assert response.status_code == 200, response.text
    assert [p.gpu_id for p in runpod.list_pods()] == [MID[1]]


def assert_out_of_capacity(response: httpx.Response) -> dict[str, Any]:
    """A 503 the caller can retry: `Retry-After`, and RunPod's own words as its reason."""
    assert response.status_code == 503, response.text
    body: dict[str, Any] = response.json()
    assert body["error"] == "no_provider_available"
    assert response.headers["Retry-After"].isdigit()
    assert int(response.headers["Retry-After"]) >= 1
    reason = body["reasons"]["runpod"]
    assert NO_CAPACITY_MESSAGE in reason and all(gpu in reason for gpu in MID)
    assert "failures" not in body
    return body


def test_graphql_learns_capacity_only_by_trying(
    start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    """GraphQL has no catalog: each candidate is tried and refused for capacity; that is a
    503 carrying RunPod's own words, not a failure, and nothing is left behind."""
    sched = start("graphql")
    for gpu in MID:
        runpod.set_no_capacity(gpu)
    assert_out_of_capacity(sched.acquire(kind="renderer", gpu="mid"))
    assert runpod.call_count("create") == 3 and runpod.list_pods() == []
    assert sched.leases() == []


def test_no_capacity_at_create_though_the_catalog_showed_stock_is_503(
    api: str, start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    """The catalog (REST) still shows every mid type in stock, but each create is refused
    with RunPod's no-instances answer: 503 with Retry-After, as for no stock at all. Real
    failures after that are still 502."""
    sched = start(api)
    for gpu in MID:
        runpod.set_no_capacity_at_create(gpu)
    assert_out_of_capacity(sched.acquire(kind="renderer", gpu="mid"))
    assert sorted(
        c.body["gpu"]["id"] if api == "rest" else c.body["variables"]["input"]["gpuTypeId"]
        for c in runpod.calls("create")
    ) == sorted(MID)  # each tried once
    if api == "rest":
        listed = HTTP.get(
            f"{runpod.base_url}/v2/catalog/gpus",
            headers=runpod.auth_headers,
            params={"include": "AVAILABILITY", "product": "POD"},
        ).json()
        assert {g["id"]: g["availability"] for g in listed["gpus"] if g["id"] in MID} == {
            gpu: "HIGH" for gpu in MID
        }
        assert runpod.call_count("catalog") >= 1
    assert runpod.list_pods() == [] and sched.leases() == []
    assert sched.metric("scheduler_acquire_failures_total", reason="no_provider") == 1

    for gpu in MID:
        runpod.set_no_capacity_at_create(gpu, False)
    # A 5xx on every try of the create is a failure, not a lack of capacity.
    runpod.fail_next(500, count=3, op="create")
    failed = sched.acquire(kind="renderer", gpu="mid")
    assert failed.status_code == 502, failed.text
    assert failed.json()["error"] == "provision_failed" and "runpod" in failed.json()["failures"]
    # So is a 400 in other words than RunPod's capacity text (a broken rule) on every type.
    runpod.fail_next(400, count=3, op="create", detail="gpu.count exceeds the maximum")
    refused = sched.acquire(kind="renderer", gpu="mid")
    assert refused.status_code == 502, refused.text
    assert "gpu.count exceeds the maximum" in refused.json()["failures"]["runpod"]
    assert runpod.list_pods() == []

    served = sched.acquire(kind="renderer", gpu="mid")
    assert served.status_code == 200, served.text


def test_runpod_out_of_capacity_beside_another_provider(
    start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    """Docker really fails (its image is missing) and RunPod has no CPU pod to give: 502,
    the Docker failure under `failures`, RunPod's capacity answer under `reasons`. With
    RunPod first and Docker working, RunPod out of capacity hands over to Docker."""
    sched = start("rest", RENDERER_IMAGE=f"openalice-missing-{uuid.uuid4().hex[:8]}:none")
    runpod.set_no_capacity_at_create("cpu5c")
    response = sched.acquire(kind="renderer", gpu="none")
    assert response.status_code == 502, response.text
    body = response.json()
    assert body["error"] == "provision_failed"
    assert list(body["failures"]) == ["local-docker"]
    assert "image" in body["failures"]["local-docker"]
    assert NO_CAPACITY_MESSAGE in body["reasons"]["runpod"]
    assert runpod.call_count("create") == 1 and runpod.list_pods() == []
    assert sched.containers() == []

    other = start("rest", PROVIDERS="runpod,local-docker")
    served = other.acquire(kind="renderer", gpu="none")
    assert served.status_code == 200, served.text
    assert served.json()["provider"] == "local-docker"
    assert runpod.call_count("create") == 2 and runpod.list_pods() == []


def test_docker_engine_down_fails_over_to_a_runpod_cpu_pod(
    start: Callable[..., Scheduler], runpod: RunPodEmulator, tmp_path: Path
) -> None:
    proxy = DockerProxy(tmp_path / "d.sock").start()
    try:
        sched = start("rest", DOCKER_HOST=proxy.url)
        local = sched.acquire(kind="renderer", gpu="none")
        assert local.status_code == 200 and local.json()["provider"] == "local-docker"

        proxy.stop()  # the engine is unreachable for this scheduler (only)
        for _ in range(2):  # first the failed provision falls over, then available() says no
            response = sched.acquire(kind="renderer", gpu="none")
            assert response.status_code == 200, response.text
            assert response.json()["provider"] == "runpod"
        pods = runpod.list_pods()
        assert len(pods) == 2
        assert all(p.cpu_id == "cpu5c" and p.gpu_id is None for p in pods)
        for call in runpod.calls("create"):
            assert call.body["cpu"] == {"id": "cpu5c", "vcpuCount": 2} and "gpu" not in call.body
        lease = response.json()["lease"]
        assert lease["endpoint"] == f"https://{lease['provider_token']}-8080.proxy.runpod.net"
        assert sched.release(lease["lease_id"]).status_code == 204
        assert len(runpod.list_pods()) == 1
    finally:
        proxy.close()


def test_kill_9_just_after_create_leaves_one_pod_destroyed_on_restart(
    api: str, start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    sched = start(api)
    runpod.set_delay(1.5, op="create")  # the create is heard, answered 1.5 s later
    outcome: list[object] = []

    def acquire() -> None:
        try:
            outcome.append(sched.acquire(kind="renderer", gpu="mid").status_code)
        except httpx.HTTPError as exc:
            outcome.append(exc)

    caller = threading.Thread(target=acquire)
    caller.start()
    wait_for(lambda: runpod.call_count("create") == 1, 30, what="create sent")
    sched.kill()
    caller.join(30)
    assert outcome and isinstance(outcome[0], httpx.HTTPError)  # no answer: it died
    wait_for(lambda: len(runpod.list_pods()) == 1, 10, what="the pod to land")
    runpod.set_delay(0, op="create")

    sched.start()  # same instance, same store
    # Start-up reconciliation runs before the service answers: the pod of the lease left
    # `provisioning` by the crash is destroyed and the lease failed.
    assert runpod.list_pods() == []
    assert runpod.call_count("create") == 1  # never a second pod
    assert sched.leases() == []
    assert sched.metric("scheduler_leases_released_total", provider="runpod", reason="failed") == 1
    # And the scheduler works on.
    response = sched.acquire(kind="renderer", gpu="mid")
    assert response.status_code == 200, response.text
    assert len(runpod.list_pods()) == 1


def test_kill_9_keeps_an_active_leases_pod(
    api: str, start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    sched = start(api)
    lease = sched.lease(kind="renderer", gpu="high")
    sched.kill()
    sched.start()
    assert sched.leases() == [lease]
    [pod] = runpod.list_pods()
    assert pod.id == lease["provider_token"]
    assert runpod.call_count("create") == 1
    assert sched.release(lease["lease_id"]).status_code == 204
    assert runpod.list_pods() == []


def test_5xx_after_create_leaves_exactly_one_pod(
    api: str, start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    sched = start(api)
    runpod.fail_next(500, op="create", after_create=True)
    lease = sched.lease(kind="renderer", gpu="mid")
    [pod] = runpod.list_pods()
    assert pod.id == lease["provider_token"] and runpod.call_count("create") == 1


def test_vanished_pod_marks_the_lease_lost(
    api: str, start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    sched = start(api, RECONCILE_INTERVAL_SECONDS="0.5")
    lease = sched.lease(kind="renderer", gpu="mid")
    kept = sched.lease(kind="renderer", gpu="entry")
    assert runpod.vanish_pod(lease["provider_token"])
    wait_for(
        lambda: [x["lease_id"] for x in sched.leases()] == [kept["lease_id"]],
        30,
        what="the lease to be marked lost",
    )
    assert sched.metric("scheduler_leases_released_total", provider="runpod", reason="lost") == 1
    assert sched.release(lease["lease_id"]).status_code == 404
    assert [p.id for p in runpod.list_pods()] == [kept["provider_token"]]


def test_duplicates_and_orphans_are_destroyed_by_reconciliation(
    api: str, start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    sched = start(api, RECONCILE_INTERVAL_SECONDS="0.5")
    lease = sched.lease(kind="renderer", gpu="mid")
    name = f"oa-{sched.instance}-{lease['lease_id']}"
    make_pod(runpod, name)  # same name, second pod
    make_pod(runpod, f"oa-{sched.instance}-{uuid.uuid4()}")  # named for us, no lease
    foreign = make_pod(runpod, f"oa-someone-else-{uuid.uuid4()}")
    wait_for(lambda: len(runpod.list_pods()) == 2, 30, what="the extras to be destroyed")
    assert sorted(p.id for p in runpod.list_pods()) == sorted([lease["provider_token"], foreign])
    assert sched.leases() == [lease]
    assert sched.metric("scheduler_leases_released_total", provider="runpod", reason="orphan") == 2


def test_schedulers_sharing_an_instance_name_but_not_a_store_leave_each_others_pods(
    api: str,
    start: Callable[..., Scheduler],
    runpod: RunPodEmulator,
    tmp_path: Path,
) -> None:
    """Pods are found by name, and two schedulers with one SCHEDULER_INSTANCE (`default`
    unless set) make the same names: each pod carries its store's id in its env, so
    neither scheduler destroys the other's pods as orphans. A pod without that entry
    (made before it existed) is still taken for this instance's."""
    instance = f"t-shared-{uuid.uuid4().hex[:8]}"
    first, second = (
        start(
            api,
            SCHEDULER_INSTANCE=instance,
            RECONCILE_INTERVAL_SECONDS="0.5",
            DATABASE_URL=f"sqlite:///{tmp_path / name}.db",
        )
        for name in ("first", "second")
    )
    leases = [first.lease(kind="renderer", gpu="mid"), second.lease(kind="renderer", gpu="mid")]
    stores = {p.env.get("OPENALICE_SCHEDULER_STORE") for p in runpod.list_pods()}
    assert len(stores) == 2 and None not in stores, stores

    unlabelled = make_pod(runpod, f"oa-{instance}-{uuid.uuid4()}")
    wait_for(
        lambda: unlabelled not in {p.id for p in runpod.list_pods()},
        30,
        what="the pod without a store to be destroyed as an orphan",
    )
    for sched in (first, second):
        passes(sched, 3)  # several more passes of each reconciler, wholly from now on
    assert sorted(p.id for p in runpod.list_pods()) == sorted(
        lease["provider_token"] for lease in leases
    )
    for sched, lease in zip((first, second), leases, strict=True):
        assert sched.leases() == [lease]
        assert (
            sched.metric("scheduler_leases_released_total", provider="runpod", reason="lost") == 0
        )
    assert "belong to another state store" in first.log() + second.log()


def test_orphans_left_while_down_are_destroyed_at_start_up(
    start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    instance = f"t-{uuid.uuid4().hex[:10]}"
    make_pod(runpod, f"oa-{instance}-{uuid.uuid4()}")
    other = make_pod(runpod, f"oa-{instance}x-{uuid.uuid4()}")
    sched = start("rest", SCHEDULER_INSTANCE=instance)
    assert [p.id for p in runpod.list_pods()] == [other]
    assert sched.metric("scheduler_leases_released_total", provider="runpod", reason="orphan") == 1


def test_a_rejected_key_makes_runpod_unavailable(
    api: str, start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    wrong = "rpk-wrong-" + uuid.uuid4().hex
    sched = start(api, key=wrong)
    # Start-up reconciliation listed the pods with the key and was refused already.
    first = sched.acquire(kind="renderer", gpu="mid")
    assert first.status_code == 503, first.text
    assert "RUNPOD_API_KEY" in first.json()["reasons"]["runpod"]
    # The one call so far: start-up reconciliation's listing. The reconciler loop's first
    # pass waits an interval after it, and the acquire knew the key was bad.
    calls = len(runpod.calls())
    assert calls == 1, runpod.calls()
    again = sched.acquire(kind="renderer", gpu="high")
    assert again.status_code == 503
    assert len(runpod.calls()) == calls  # a key known to be bad is not tried again
    for response in (first, again):
        assert wrong not in response.text
    assert runpod.list_pods() == []


def test_the_key_is_never_in_logs_answers_metrics_or_spans(
    api: str, start: Callable[..., Scheduler], runpod: RunPodEmulator
) -> None:
    receiver = OtlpReceiver()
    endpoint = receiver.start()
    try:
        sched = start(api, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
        answers: list[httpx.Response] = []
        lease = sched.acquire(kind="renderer", gpu="mid")
        answers.append(lease)
        answers.append(sched.release(lease.json()["lease"]["lease_id"]))
        # RunPod answers that echo the key back: every candidate refused, then a contract
        # break, then a key refusal. None of it may carry the key onwards.
        for _ in MID:
            runpod.fail_next(400, op="create", detail=f"no capacity for token {KEY}")
        answers.append(sched.acquire(kind="renderer", gpu="mid"))
        assert answers[-1].status_code == 502 and "[redacted]" in answers[-1].text
        runpod.fail_next(422, op="create", detail=f"bad body from {KEY}")
        answers.append(sched.acquire(kind="renderer", gpu="mid"))
        assert answers[-1].status_code == 502
        runpod.fail_next(500, count=10, op="terminate", detail=f"oops {KEY}")
        held = sched.lease(kind="renderer", gpu="mid")
        answers.append(sched.release(held["lease_id"]))
        assert answers[-1].status_code == 502  # stays releasing; the sweeper retries
        runpod.fail_next(401, op="create", detail=f"token {KEY} is not valid")
        answers.append(sched.acquire(kind="renderer", gpu="mid"))
        answers.append(sched.acquire(kind="renderer", gpu="mid"))  # now unavailable: 503
        assert answers[-1].status_code == 503
        answers.append(sched.http.get("/v1/leases"))
        answers.append(HTTP.get(f"{sched.url}/metrics"))
        answers.append(HTTP.get(f"{sched.url}/health"))
        for answer in answers:
            assert KEY not in answer.text, answer.text
            assert all(KEY not in value for value in answer.headers.values())
        wait_for(lambda: len(receiver.named("provision")) >= 4, 30, what="provision spans")
        sched.stop()  # flushes the remaining spans
        assert receiver.raw_requests
        assert KEY.encode() not in b"".join(receiver.raw_requests)
        log = sched.log()
        assert "DEBUG" in log and KEY not in log
        assert "no capacity for token" in log  # RunPod's detail reached the log, key-less
    finally:
        receiver.stop()
    assert all(KEY not in call.path for call in runpod.calls())
