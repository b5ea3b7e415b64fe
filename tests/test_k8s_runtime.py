"""The wait for a pod as real clusters make it (issue 35), against the Kubernetes emulator
(tests/k8s_emulator/) and its cluster autoscaler, under the Role the docs give
(docs/backends/kubernetes.md#the-rbac-the-scheduler-needs): a scale-up waited for, a pod
the autoscaler cannot help refused at once, refused and expired watches, transient and
final image pulls (docs/backends/kubernetes.md#the-wait-for-a-pod)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from lightkube import Client, KubeConfig
from lightkube.resources.core_v1 import Event, Pod

from tests.harness import WORKER_IMAGE, Scheduler, wait_for
from tests.k8s_emulator import KubeEmulator
from tests.test_k8s_provider import NAMESPACE, documented_role, on_k8s, pod_calls

Make = Callable[..., Scheduler]


@pytest.fixture
def kube(kube_server: KubeEmulator) -> KubeEmulator:
    kube_server.reset()
    kube_server.set_rbac(documented_role()["rules"])
    return kube_server


def none_provisioning(sched: Scheduler) -> bool:
    """No lease of the scheduler is left `provisioning`."""
    stuck = sched.http.get("/v1/leases", params={"state": ["provisioning"]})
    assert stuck.status_code == 200, stuck.text
    return stuck.json() == []


def nothing_left(kube: KubeEmulator) -> bool:
    return not kube.pods(NAMESPACE) and not kube.secrets(NAMESPACE)


def acquiring(sched: Scheduler, **body: Any) -> tuple[threading.Thread, dict[str, httpx.Response]]:
    """An acquire under way in a thread of its own; its answer, once given, in ["answer"]."""
    got: dict[str, httpx.Response] = {}
    caller = threading.Thread(target=lambda: got.update(answer=sched.acquire(**body)), daemon=True)
    caller.start()
    return caller, got


def answered_on(
    kube: KubeEmulator, caller: threading.Thread, got: dict[str, httpx.Response], node: str
) -> None:
    """The acquire under way (`acquiring`) is answered with an active lease on Kubernetes,
    its pod placed on `node`."""
    caller.join(120)
    answer = got["answer"]
    assert answer.status_code == 200, answer.text
    lease = answer.json()["lease"]
    assert lease["provider"] == "kubernetes" and lease["state"] == "active"
    assert _node(kube, lease["provider_token"]) == node


# --- scale-up --------------------------------------------------------------------------

# A cluster of one CPU node, and an autoscaled pool of L4 nodes (none yet) that takes
# 3 minutes to bring a node.
CPU_NODE = {"name": "cpu-1", "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"}}
L4_TEMPLATE = {
    "labels": {"nvidia.com/gpu.product": "NVIDIA-L4"},
    "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110", "nvidia.com/gpu": "1"},
}
L4_POOL = {
    "name": "l4-pool",
    "template": L4_TEMPLATE,
    "maxSize": 2,
    "delaySeconds": 180,
}


def autoscaler_events(kube: KubeEmulator, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in kube.events(NAMESPACE)
        if e["reason"] == reason and e["source"]["component"] == "cluster-autoscaler"
    ]


def test_a_lease_waits_for_the_autoscaler_s_new_node(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, K8S_SCHEDULE_TIMEOUT_SECONDS="3")
    kube.set_nodes([CPU_NODE])
    kube.set_node_groups([L4_POOL])
    caller, got = acquiring(sched, kind="renderer", gpu="entry", ttl_seconds=300)
    wait_for(lambda: autoscaler_events(kube, "TriggeredScaleUp"), 60, what="a scale-up")
    [event] = autoscaler_events(kube, "TriggeredScaleUp")
    assert event["message"] == "pod triggered scale-up: [{l4-pool 0->1 (max: 2)}]"
    created = pod_calls(kube, "create")[-1]["time"]

    def outlived_its_schedule_timeout() -> bool:
        assert "answer" not in got, got["answer"].text  # still waiting, not refused
        return time.time() > created + 6  # K8S_SCHEDULE_TIMEOUT_SECONDS, twice

    wait_for(outlived_its_schedule_timeout, 60, what="the pod to outlive its schedule timeout")
    kube.advance_clock(180)  # the node arrives; the pod is placed there
    answered_on(kube, caller, got, "l4-pool-1")


def test_a_pod_unschedulable_past_a_read_of_its_events_is_placed_once_a_node_comes(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    """No autoscaler: the pod waits out K8S_SCHEDULE_TIMEOUT_SECONDS, its events read
    every 5 s meanwhile. A node that comes after a read places it, and the lease is
    answered. (Each read once ended the wait for the pod's next change for good, the watch
    cancelled under it: the next look found it finished and the acquire answered 500.)"""
    sched = on_k8s(make_scheduler, kube, K8S_SCHEDULE_TIMEOUT_SECONDS="120")
    kube.set_nodes([CPU_NODE])
    caller, got = acquiring(sched, kind="renderer", gpu="entry", ttl_seconds=300)

    def events_read_twice() -> bool:
        assert "answer" not in got, got["answer"].text  # still waiting
        reads = [r for r in kube.requests() if (r["verb"], r["resource"]) == ("list", "events")]
        return len(reads) >= 2

    wait_for(events_read_twice, 60, what="two reads of the pod's events, 5 s apart")
    kube.set_nodes([CPU_NODE, {"name": "l4-1", **L4_TEMPLATE}])
    answered_on(kube, caller, got, "l4-1")


def test_a_pod_the_autoscaler_cannot_help_is_refused_at_once(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    # Were the autoscaler not heard, the acquire would wait 10 minutes.
    sched = on_k8s(make_scheduler, kube, K8S_SCHEDULE_TIMEOUT_SECONDS="600")
    kube.set_nodes([CPU_NODE])
    h100 = {
        **L4_POOL,
        "name": "h100-pool",
        "template": {**L4_TEMPLATE, "labels": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
    }
    kube.set_node_groups([h100])
    refused = sched.acquire(kind="renderer", gpu="entry", ttl_seconds=300)
    assert refused.status_code == 503, refused.text
    reason = refused.json()["reasons"]["kubernetes"]
    words = "pod didn't trigger scale-up: 1 node(s) didn't match Pod's node affinity/selector"
    assert words in reason and "cluster autoscaler" in reason, reason
    assert none_provisioning(sched)
    wait_for(lambda: nothing_left(kube), 30, what="the pod to be deleted")


# --- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "words"),
    [(403, "403 Forbidden"), (429, "429 Too Many Requests"), (503, "503 Service Unavailable")],
)
def test_a_refused_watch_ends_the_attempt_with_a_reason_and_leaves_nothing(
    make_scheduler: Make, kube: KubeEmulator, code: int, words: str
) -> None:
    sched = on_k8s(make_scheduler, kube)
    # Every watch of pods is refused (429 and 503 after lightkube's own retries).
    kube.fail_next(1000, code, verb="watch", resource="pods")
    refused = sched.acquire(kind="renderer", ttl_seconds=300)
    assert refused.status_code == 503, refused.text
    reason = refused.json()["reasons"]["kubernetes"]
    assert reason.startswith("watching pod oa-") and words in reason, reason
    kube.clear_faults()
    assert none_provisioning(sched)
    wait_for(lambda: nothing_left(kube), 30, what="the pod and its secret to be deleted")


def test_a_watch_refused_when_it_is_made_again_ends_the_attempt(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube)
    kube.pause_kubelet()  # the pod waits: its watch is open
    caller, got = acquiring(sched, kind="renderer", ttl_seconds=300)
    wait_for(lambda: _pod_watches(kube) >= 1, 60, what="the pod's own watch to open")
    # The API server ends its watches (their timeout), and refuses them from now on.
    kube.fail_next(1000, 403, verb="watch", resource="pods")
    assert kube.end_watches() >= 1
    caller.join(120)
    refused = got["answer"]
    assert refused.status_code == 503, refused.text
    reason = refused.json()["reasons"]["kubernetes"]
    assert reason.startswith("watching pod oa-") and "403 Forbidden" in reason, reason
    kube.clear_faults()
    kube.resume_kubelet()
    assert none_provisioning(sched)
    wait_for(lambda: nothing_left(kube), 30, what="the pod and its secret to be deleted")


def test_a_watch_whose_connection_drops_ends_the_attempt_with_a_reason(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube)
    kube.drop_next(1000, verb="watch", resource="pods")  # no answer: the connection closes
    refused = sched.acquire(kind="renderer", ttl_seconds=300)
    assert refused.status_code == 503, refused.text
    reason = refused.json()["reasons"]["kubernetes"]
    assert reason.startswith("watching pod oa-") and "Server disconnected" in reason, reason
    kube.clear_faults()
    assert none_provisioning(sched)
    wait_for(lambda: nothing_left(kube), 30, what="the pod and its secret to be deleted")


def test_a_refused_call_goes_to_the_next_provider(make_scheduler: Make, kube: KubeEmulator) -> None:
    sched = on_k8s(make_scheduler, kube, PROVIDERS="kubernetes,local-docker")
    # The pod is made; its secret is refused for good.
    kube.fail_next(1000, 403, verb="create", resource="secrets")
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert lease["provider"] == "local-docker"
    kube.clear_faults()
    assert none_provisioning(sched)
    wait_for(lambda: nothing_left(kube), 30, what="the pod to be deleted")
    assert sched.release(lease["lease_id"]).status_code == 204


def test_an_expired_watch_resumes_and_the_lease_becomes_active(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube)
    kube.pause_kubelet()  # the pod is made and waits: its watch is open
    got: dict[str, httpx.Response] = {}
    caller = threading.Thread(
        target=lambda: got.update(answer=sched.acquire(kind="renderer", ttl_seconds=300)),
        daemon=True,
    )
    caller.start()
    wait_for(lambda: _pod_watches(kube) >= 1, 60, what="the pod's own watch to open")
    # etcd compacted: the open watches get an in-stream ERROR 410 and end.
    assert kube.expire_watches() >= 1
    kube.resume_kubelet()
    caller.join(120)
    answer = got["answer"]
    assert answer.status_code == 200, answer.text
    lease = answer.json()["lease"]
    assert lease["state"] == "active" and lease["provider"] == "kubernetes"
    # The pod was read again after the expiry, and watched from there.
    assert pod_calls(kube, "get", lease["provider_token"])


def _pod_watches(kube: KubeEmulator) -> int:
    """The watches opened on one pod by name (the provision's own, not the namespace's)."""
    return len(
        [r for r in pod_calls(kube, "watch") if r["code"] == 200 and not r.get("label_selector")]
    )


# --- image pulls -----------------------------------------------------------------------


def test_a_transient_pull_error_is_waited_out(make_scheduler: Make, kube: KubeEmulator) -> None:
    sched = on_k8s(make_scheduler, kube)
    kube.set_flaky_pulls({WORKER_IMAGE: 2})  # ErrImagePull twice, then pulled
    got: dict[str, httpx.Response] = {}
    caller = threading.Thread(
        target=lambda: got.update(answer=sched.acquire(kind="renderer", ttl_seconds=300)),
        daemon=True,
    )
    caller.start()
    for _ in range(2):
        wait_for(lambda: _waiting(kube) == "ImagePullBackOff", 60, what="a pull backing off")
        kube.advance_clock(30)  # past the kubelet's backoff: the next pull
    caller.join(120)
    answer = got["answer"]
    assert answer.status_code == 200, answer.text
    assert answer.json()["lease"]["state"] == "active"


def test_a_final_pull_error_fails_at_once(make_scheduler: Make, kube: KubeEmulator) -> None:
    invalid = "registry.invalid/OpenAlice/Worker:1"  # capitals: not an image reference
    sched = on_k8s(make_scheduler, kube, K8S_RENDERER_IMAGE=invalid)
    failed = sched.acquire(kind="renderer", ttl_seconds=300)
    assert failed.status_code == 502, failed.text
    assert "will not start: InvalidImageName" in failed.json()["message"], failed.text
    assert none_provisioning(sched)
    wait_for(lambda: nothing_left(kube), 30, what="the pod to be deleted")


def _waiting(kube: KubeEmulator) -> str | None:
    """The waiting reason of the one pod's container, if any."""
    for pod in kube.pods(NAMESPACE):
        for status in pod["status"].get("containerStatuses") or []:
            waiting: dict[str, Any] = status.get("state", {}).get("waiting") or {}
            return waiting.get("reason")
    return None


# --- the emulator's autoscaler and pulls, through lightkube -----------------------------


def test_the_emulated_autoscaler_brings_a_node_after_its_delay_with_its_events(
    kube: KubeEmulator,
) -> None:
    client = Client(KubeConfig.from_file(kube.kubeconfig_path))
    kube.pause_kubelet()  # placement only: no container is needed
    kube.set_nodes([CPU_NODE])
    kube.set_node_groups([{**L4_POOL, "maxSize": 1, "delaySeconds": 60}])
    l4 = {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"},
        "containers": [
            {
                "name": "worker",
                "image": WORKER_IMAGE,
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
            }
        ],
    }
    client.create(Pod.from_dict({"metadata": {"name": "first"}, "spec": l4}))
    kube.sync()
    [event] = client.list(Event, fields={"involvedObject.name": "first"})
    assert (event.reason, event.type, event.source and event.source.component) == (
        "TriggeredScaleUp",
        "Normal",
        "cluster-autoscaler",
    )
    assert event.message == "pod triggered scale-up: [{l4-pool 0->1 (max: 1)}]"
    assert event.involvedObject.kind == "Pod" and event.involvedObject.uid
    kube.advance_clock(59)
    assert _node(kube, "first") is None
    kube.advance_clock(1)
    wait_for(lambda: _node(kube, "first") == "l4-pool-1", 30)
    # The pool is at its size: a second pod is told so, and stays unschedulable.
    client.create(Pod.from_dict({"metadata": {"name": "second"}, "spec": l4}))
    kube.sync()
    [refused] = client.list(Event, fields={"involvedObject.name": "second"})
    assert (refused.reason, refused.message) == (
        "NotTriggerScaleUp",
        "pod didn't trigger scale-up: 1 max node group size reached",
    )
    kube.set_node_groups([])  # no autoscaler: no word at all
    client.create(Pod.from_dict({"metadata": {"name": "third"}, "spec": l4}))
    kube.sync()
    assert list(client.list(Event, fields={"involvedObject.name": "third"})) == []


def test_the_emulated_kubelet_reports_a_bad_image_name_and_a_never_pull(
    kube: KubeEmulator,
) -> None:
    client = Client(KubeConfig.from_file(kube.kubeconfig_path))
    for name, container in (
        ("badname", {"image": "registry.invalid/OpenAlice/Worker:1"}),
        ("neverpull", {"image": "openalice-no-such-image:1", "imagePullPolicy": "Never"}),
    ):
        spec = {"restartPolicy": "Never", "containers": [{"name": "worker", **container}]}
        client.create(Pod.from_dict({"metadata": {"name": name}, "spec": spec}))
    wait_for(lambda: _reason(kube, "badname") == "InvalidImageName", 30)
    wait_for(lambda: _reason(kube, "neverpull") == "ErrImageNeverPull", 30)
    assert _message(kube, "badname") == (
        'Failed to apply default image tag "registry.invalid/OpenAlice/Worker:1": couldn\'t '
        'parse image name "registry.invalid/OpenAlice/Worker:1": invalid reference format'
    )
    assert _message(kube, "neverpull") == (
        'Container image "openalice-no-such-image:1" is not present with pull policy of Never'
    )


def _node(kube: KubeEmulator, name: str) -> str | None:
    """The node the pod `name` is bound to, if any."""
    return ((kube.pod(name) or {}).get("spec") or {}).get("nodeName")


def _state(kube: KubeEmulator, name: str) -> dict[str, Any]:
    pod = kube.pod(name) or {}
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    waiting: dict[str, Any] = statuses[0].get("state", {}).get("waiting") or {}
    return waiting


def _reason(kube: KubeEmulator, name: str) -> str | None:
    return _state(kube, name).get("reason")


def _message(kube: KubeEmulator, name: str) -> str | None:
    return _state(kube, name).get("message")
