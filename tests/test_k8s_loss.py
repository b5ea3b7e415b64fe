"""A worker on Kubernetes seen after its hand-out (issue 33), against the Kubernetes
emulator (tests/k8s_emulator/), the scheduler as a process under the documented Role
(docs/backends/kubernetes.md#the-rbac-the-scheduler-needs):

- ready when handed out: a pod whose container runs (so Kubernetes calls it Ready, having
  no readiness probe) but whose worker listens only seconds later is handed out once it
  answers the scheduler's own probe (a TCP connect), and without that probe it would not;
- a death after the hand-out ends the lease within seconds, heard from the scheduler's
  watch of its pods: `released`, reason `lost`, the cause Kubernetes gives (the worker
  exited, was OOM-killed, was evicted, lost its node, reached its deadline, or its pod was
  deleted) with the exit code; a renewal answers 409 `worker_lost`; the room is free at
  once; the pod and its Secret are deleted; /metrics counts it;
- nothing is ended by mistake: a watch the API server ends, or whose version expires,
  comes back and still hears; a restart finds the death it missed and keeps the healthy;
- an idle warm-pool pod that dies is recycled and replaced.

Where the point is that the watch noticed, the reconciler is set to an hour: the only
passes are start-up's and the one each (re)opened watch wakes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.harness import HTTP, Scheduler, wait_for
from tests.k8s_emulator import KubeEmulator
from tests.k8s_emulator.scheduling import DEFAULT_NODES
from tests.loss import lease_now, lost, renew, renewal_refused_as_lost
from tests.test_k8s_provider import (
    NAMESPACE,
    documented_role,
    gone,
    on_k8s,
    pod_calls,
    pod_of,
)
from tests.test_warm_pool import wait_idle

Make = Callable[..., Scheduler]
# Only the watch may notice, in these tests: no reconcile pass within them.
WATCH_ONLY = {"RECONCILE_INTERVAL_SECONDS": "3600"}
# The probe a TCP connect to the worker's port: no ready path.
NO_READY_PATH = {"RENDERER_READY_PATH": "", "ANIM_READY_PATH": ""}
LOST = "scheduler_workers_lost_total"


@pytest.fixture
def kube(kube_server: KubeEmulator) -> Iterator[KubeEmulator]:
    """The module's emulator, emptied, under the Role the docs give (as in
    test_k8s_provider.py); after the test, every call the scheduler made was allowed by
    that Role (the emulator enforces it)."""
    kube_server.reset()
    kube_server.set_rbac(documented_role()["rules"])
    yield kube_server
    refused = [(r["verb"], r["resource"]) for r in kube_server.requests() if r["code"] == 403]
    assert not refused, f"the documented Role refused {refused}"


def exit_worker(lease: dict[str, Any], code: int) -> None:
    """The worker ends itself with `code`, as one that crashes does."""
    answer = HTTP.get(f"{lease['endpoint']}/cgi-bin/exit?{code}", timeout=10)
    assert answer.json() == {"exiting": code}, answer.text


def kept(sched: Scheduler, kube: KubeEmulator, lease: dict[str, Any]) -> bool:
    """Whether a healthy lease is untouched: still active, its pod running."""
    pod = pod_of(kube, lease)
    return (
        lease_now(sched, lease)["state"] == "active"
        and pod is not None
        and pod["status"].get("phase") == "Running"
        and not pod["metadata"].get("deletionTimestamp")
    )


def reconciled_at(sched: Scheduler) -> float:
    """When the scheduler last finished a reconcile pass (Unix time)."""
    return sched.metric("scheduler_reconcile_last_success_timestamp_seconds")


def pod_calls_since(kube: KubeEmulator, sched: Scheduler, verb: str, since: float) -> list[Any]:
    """The scheduler's `verb` calls on its pods (by its instance label) after `since`."""
    return [
        r
        for r in pod_calls(kube, verb)
        if r["time"] > since
        and f"openalice.io/instance={sched.instance}" in r.get("label_selector", "")
    ]


def watch_settled(sched: Scheduler, kube: KubeEmulator, since: float = 0.0) -> float:
    """Waits until the scheduler has (re)opened its watch of its pods after `since` (a
    listing, then a watch) and the reconcile pass that listing woke has finished; when
    it finished (no later pass runs with the reconciler set to an hour). The listing
    the watch starts from is the last before the watch: start-up's own pass ended
    before it, the woken pass ends after it."""

    def opened() -> float | None:
        calls = sorted(
            pod_calls_since(kube, sched, "list", since)
            + pod_calls_since(kube, sched, "watch", since),
            key=lambda r: r["time"],
        )
        first_watch = next((i for i, r in enumerate(calls) if r["verb"] == "watch"), None)
        if not first_watch:  # no watch yet, or no listing before it
            return None
        return float(calls[first_watch - 1]["time"])

    listed = wait_for(opened, 30, 0.1, what="the pods listed, then watched")
    return float(
        wait_for(
            lambda: (at := reconciled_at(sched)) > listed and at,
            30,
            0.1,
            what="the reconcile pass the watch's listing woke",
        )
    )


def assert_lost(
    sched: Scheduler,
    kube: KubeEmulator,
    lease: dict[str, Any],
    cause: str,
    exit_code: int | None,
) -> dict[str, Any]:
    """What a user sees of a lease whose worker died: the lease ended `lost` with its
    cause and exit code, a renewal refused naming them, the pod and its Secret deleted,
    the death counted once."""
    now = lost(sched, lease, cause, exit_code)
    renewal_refused_as_lost(sched, lease, cause, exit_code)
    wait_for(lambda: gone(kube, lease), 30, what="the dead pod and its secret deleted")
    assert sched.metric(LOST, provider="kubernetes", cause=cause) == 1
    return now


# --- ready when handed out ------------------------------------------------------------


def test_a_pod_slow_to_listen_is_handed_out_once_it_answers(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, **NO_READY_PATH)
    # The container runs at once (Kubernetes calls the pod Ready: it has no readiness
    # probe); the worker listens 3 s later. The scheduler's TCP probe waits for it.
    started = time.monotonic()
    lease = sched.lease(kind="renderer", ttl_seconds=300, env={"LISTEN_DELAY_SECONDS": "3"})
    assert time.monotonic() - started >= 3
    # The caller's very first request succeeds: one attempt, no retry.
    page = HTTP.get(lease["endpoint"] + "/", timeout=10).json()
    assert page["lease_id"] == lease["lease_id"]
    assert lease_now(sched, lease)["state"] == "active"


def test_without_the_probe_the_same_pod_refuses_its_first_caller(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    # What the test above would see if the scheduler handed a pod out as Kubernetes
    # calls it Ready (K8S_READY_TIMEOUT_SECONDS=0: not probed): the caller's first
    # connection refused. The worker listens later than above (6 s): the lease is
    # answered within moments of the container's start, even on a loaded machine.
    sched = on_k8s(make_scheduler, kube, K8S_READY_TIMEOUT_SECONDS="0", **NO_READY_PATH)
    lease = sched.lease(kind="renderer", ttl_seconds=300, env={"LISTEN_DELAY_SECONDS": "6"})
    pod = pod_of(kube, lease)
    assert pod is not None and pod["status"]["phase"] == "Running"
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    with pytest.raises(httpx.ConnectError):
        HTTP.get(lease["endpoint"] + "/", timeout=10)
    # The same worker answers once it listens.
    wait_for(
        lambda: _answers(lease["endpoint"] + "/"),
        60,
        0.2,
        what="the worker to listen",
    )


def _answers(url: str) -> bool:
    try:
        return HTTP.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


# --- a death after the hand-out ----------------------------------------------------------


def test_a_worker_that_exits_ends_its_lease_and_frees_its_pod_s_room(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, K8S_MAX_PODS="1", **WATCH_ONLY)
    lease = sched.lease(kind="renderer", owner_id="me", ttl_seconds=300)
    full = sched.acquire(kind="renderer", ttl_seconds=300)
    assert full.status_code == 503, full.text  # at capacity, as the issue found it
    passes = watch_settled(sched, kube)

    exit_worker(lease, 3)
    assert_lost(sched, kube, lease, "exited", 3)
    # The room is free at once: the next caller is served.
    again = sched.acquire(kind="renderer", ttl_seconds=300)
    assert again.status_code == 200, again.text
    # Heard from the watch: no reconcile pass ran meanwhile.
    assert reconciled_at(sched) == passes
    assert (
        sched.metric("scheduler_leases_released_total", provider="kubernetes", reason="lost") == 1
    )
    # The scheduler deleted the failed pod (the emulator's kubelet keeps it otherwise).
    assert pod_calls(kube, "delete", lease["provider_token"]), "the dead pod was never deleted"


def _oom(kube: KubeEmulator, lease: dict[str, Any]) -> None:
    pod = kube.oom_kill(lease["provider_token"])
    [status] = pod["status"]["containerStatuses"]
    assert status["state"]["terminated"]["reason"] == "OOMKilled"


def _evict(kube: KubeEmulator, lease: dict[str, Any]) -> None:
    pod = kube.evict(lease["provider_token"])
    # The demo worker exits 0 at the SIGTERM: the pod ends Succeeded, with no reason;
    # only its DisruptionTarget condition tells the eviction.
    assert pod["status"]["phase"] == "Succeeded" and not pod["status"].get("reason")
    conditions = {c["type"]: c for c in pod["status"]["conditions"]}
    assert conditions["DisruptionTarget"]["reason"] == "TerminationByKubelet"


def _lose_node(kube: KubeEmulator, lease: dict[str, Any]) -> None:
    pod = pod_of(kube, lease)
    assert pod is not None and pod["spec"]["nodeName"] == "node-1"
    assert kube.lose_node("node-1") == [f"{NAMESPACE}/{lease['provider_token']}"]


def _deadline(kube: KubeEmulator, lease: dict[str, Any]) -> None:
    # K8S_POD_DEADLINE_SECONDS=120 (the lease's TTL 100): the kubelet ends it at 120 s.
    assert kube.advance_clock(130) == [f"{NAMESPACE}/{lease['provider_token']}"]


@pytest.mark.parametrize(
    ("death", "cause", "exit_code", "env"),
    [
        pytest.param(_oom, "oom_killed", 137, {}, id="oom_killed"),
        pytest.param(_evict, "evicted", 0, {}, id="evicted"),
        pytest.param(_lose_node, "node_lost", None, {}, id="node_lost"),
        pytest.param(_deadline, "deadline", 0, {"K8S_POD_DEADLINE_SECONDS": "120"}, id="deadline"),
    ],
)
def test_each_way_a_pod_dies_is_its_lease_s_lost_cause(
    make_scheduler: Make,
    kube: KubeEmulator,
    death: Callable[[KubeEmulator, dict[str, Any]], None],
    cause: str,
    exit_code: int | None,
    env: dict[str, str],
) -> None:
    sched = on_k8s(make_scheduler, kube, **WATCH_ONLY, **env)
    lease = sched.lease(kind="renderer", ttl_seconds=100)
    passes = watch_settled(sched, kube)
    try:
        death(kube, lease)
        assert_lost(sched, kube, lease, cause, exit_code)
        assert reconciled_at(sched) == passes  # the watch heard it
    finally:
        kube.set_nodes([dict(n) for n in DEFAULT_NODES])  # a lost node comes back
    # Another pod is served (on the node back, for node_lost).
    assert sched.acquire(kind="renderer", ttl_seconds=100).status_code == 200


def test_a_pod_deleted_behind_the_scheduler_s_back_is_lost_of_unknown_cause(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, **WATCH_ONLY)
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    from lightkube import Client, KubeConfig
    from lightkube.resources.core_v1 import Pod

    client = Client(config=KubeConfig.from_file(kube.kubeconfig_path), namespace=NAMESPACE)
    client.delete(Pod, lease["provider_token"], grace_period=0)
    assert_lost(sched, kube, lease, "unknown", None)


# --- nothing ended by mistake ---------------------------------------------------------


def _end_watches(sched: Scheduler, kube: KubeEmulator) -> float:
    """The API server ends the scheduler's watch: it watches again, from the last version
    it heard. When the last reconcile pass finished."""
    passes = watch_settled(sched, kube)
    since = time.time()
    assert kube.end_watches() >= 1
    wait_for(
        lambda: pod_calls_since(kube, sched, "watch", since), 30, what="the pods watched again"
    )
    return passes


def _expire_watches(sched: Scheduler, kube: KubeEmulator) -> float:
    """The version the scheduler's watch started from expires: it lists its pods again,
    watches from there, and the reconciler's pass (woken by the new listing) judges what
    the listing shows. When that pass finished."""
    watch_settled(sched, kube)
    since = time.time()
    assert kube.expire_watches() >= 1
    return watch_settled(sched, kube, since)


@pytest.mark.parametrize(
    "interrupt",
    [
        pytest.param(_end_watches, id="the_api_server_ends_it"),
        pytest.param(_expire_watches, id="its_version_expires"),
    ],
)
def test_a_watch_interrupted_comes_back_keeps_the_healthy_and_still_hears(
    make_scheduler: Make,
    kube: KubeEmulator,
    interrupt: Callable[[Scheduler, KubeEmulator], float],
) -> None:
    sched = on_k8s(make_scheduler, kube, **WATCH_ONLY)
    healthy = sched.lease(kind="renderer", ttl_seconds=300)
    doomed = sched.lease(kind="renderer", ttl_seconds=300)
    passes = interrupt(sched, kube)
    assert kept(sched, kube, healthy)

    exit_worker(doomed, 4)
    assert_lost(sched, kube, doomed, "exited", 4)
    assert reconciled_at(sched) == passes  # the watch, made again, heard it
    assert kept(sched, kube, healthy)
    assert renew(sched, healthy).status_code == 200


def test_a_death_while_the_scheduler_was_down_is_found_at_start_up(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, **WATCH_ONLY)
    healthy = sched.lease(kind="renderer", ttl_seconds=300)
    doomed = sched.lease(kind="renderer", ttl_seconds=300)
    sched.kill()
    exit_worker(doomed, 6)
    wait_for(
        lambda: (pod_of(kube, doomed) or {}).get("status", {}).get("phase") == "Failed",
        30,
        what="the pod to fail while no scheduler runs",
    )
    sched.start()  # the same store and instance
    assert_lost(sched, kube, doomed, "exited", 6)
    # The healthy lease was judged by the same listing, and kept.
    assert kept(sched, kube, healthy)
    assert renew(sched, healthy).status_code == 200


# --- the warm pool ------------------------------------------------------------------------


def test_an_idle_pool_pod_that_dies_is_recycled_and_replaced(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, WARM_POOL="renderer/none=1", **WATCH_ONLY)
    wait_idle(sched, 1)
    [idle] = sched.http.get("/v1/leases", params={"state": "idle"}).json()
    kube.oom_kill(idle["provider_token"])
    lost(sched, idle, "oom_killed", 137, reason="recycled")
    wait_for(lambda: gone(kube, idle), 30, what="the dead pool pod deleted")
    assert sched.metric(LOST, provider="kubernetes", cause="oom_killed") == 1

    def replaced() -> bool:
        rows = sched.http.get("/v1/leases", params={"state": "idle"}).json()
        return len(rows) == 1 and rows[0]["lease_id"] != idle["lease_id"]

    wait_for(replaced, 60, 0.2, what="a new idle pool pod")


# --- the documented Role -------------------------------------------------------------


def test_the_pod_watch_lists_and_watches_under_the_documented_role(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    since = time.time()
    sched = on_k8s(make_scheduler, kube, **WATCH_ONLY)
    # The watch of the namespace's pods, by this scheduler's label: a list, then a watch,
    # each allowed by the Role the docs give.
    [listed, *_] = wait_for(
        lambda: pod_calls_since(kube, sched, "list", since), 30, what="the pods listed"
    )
    [watched, *_] = wait_for(
        lambda: pod_calls_since(kube, sched, "watch", since), 30, what="the pods watched"
    )
    assert listed["code"] == 200 and watched["code"] == 200, (listed, watched)
    assert listed["namespace"] == NAMESPACE and watched["namespace"] == NAMESPACE
