"""Workers on Kubernetes (issue 27), against the Kubernetes emulator (tests/k8s_emulator/):
the scheduler as a process with lightkube pointed at the emulator through a kubeconfig
file, as a user would, each pod a real Docker container of the demo worker, started,
probed, ended at its deadline and deleted with its grace period by the emulator's test
kubelet. Every test runs under the Role the docs give
(docs/backends/kubernetes.md#the-rbac-the-scheduler-needs; the emulator refuses any other
verb with 403), and one test checks that the code uses exactly that Role's verbs."""

from __future__ import annotations

import base64
import contextlib
import re
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.guardproc import GuardProcess
from tests.harness import WORKER_IMAGE, Scheduler, wait_for
from tests.k8s_emulator import KubeEmulator
from tests.loss import lost
from tests.test_guard import Alive, Stopped, leases_learned, only_the_expired_goes
from tests.test_priorities import PREEMPTING, anim_preempted_for_live
from tests.test_warm_pool import handed_over_warm, wait_idle

Make = Callable[..., Scheduler]
KUBERNETES_PAGE = Path(__file__).resolve().parents[1] / "docs" / "backends" / "kubernetes.md"
NAMESPACE = "openalice"
L4 = "entry=nvidia.com/gpu:1@nvidia.com/gpu.product=NVIDIA-L4"


def documented_role() -> dict[str, Any]:
    """The Role the docs give the scheduler's service account (docs/backends/kubernetes.md)."""
    text = KUBERNETES_PAGE.read_text()
    for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL):
        for doc in yaml.safe_load_all(block):
            if isinstance(doc, dict) and doc.get("kind") == "Role":
                return doc
    raise AssertionError("docs/backends/kubernetes.md gives no Role")


@pytest.fixture
def kube(kube_server: KubeEmulator) -> KubeEmulator:
    kube_server.reset()
    kube_server.set_rbac(documented_role()["rules"])
    return kube_server


def on_k8s(make_scheduler: Make, emulator: KubeEmulator, **env: str) -> Scheduler:
    settings = {
        "PROVIDERS": "kubernetes",
        "KUBECONFIG": str(emulator.kubeconfig_path),
        "K8S_RENDERER_IMAGE": WORKER_IMAGE,
        "K8S_ANIM_IMAGE": WORKER_IMAGE,
        "K8S_GPU_CLASSES": L4,
        "K8S_PRICE_PER_HOUR": "none=0.05,entry=0.7",
        "K8S_TERMINATION_GRACE_SECONDS": "3",
        "RENDERER_READY_PATH": "/healthz",
        "ANIM_READY_PATH": "/healthz",
    }
    return make_scheduler(**{**settings, **env})


def pod_of(emulator: KubeEmulator, lease: dict[str, Any]) -> dict[str, Any] | None:
    """The lease's pod as the API holds it (None: gone)."""
    return emulator.pod(lease["provider_token"], NAMESPACE)


def pods_of(emulator: KubeEmulator, lease_id: str) -> list[dict[str, Any]]:
    return [
        p
        for p in emulator.pods(NAMESPACE)
        if p["metadata"].get("labels", {}).get("openalice.io/lease") == lease_id
    ]


def secrets_of(emulator: KubeEmulator, lease_id: str) -> list[dict[str, Any]]:
    return [
        s
        for s in emulator.secrets(NAMESPACE)
        if s["metadata"].get("labels", {}).get("openalice.io/lease") == lease_id
    ]


def gone(emulator: KubeEmulator, lease: dict[str, Any]) -> bool:
    return not pods_of(emulator, lease["lease_id"]) and not secrets_of(emulator, lease["lease_id"])


def pod_calls(emulator: KubeEmulator, verb: str, name: str | None = None) -> list[dict[str, Any]]:
    """The API server's record of the `verb` calls on pods (on the pod `name` only, if
    given), in their order."""
    return [
        r
        for r in emulator.requests()
        if r["verb"] == verb and r["resource"] == "pods" and (name is None or r.get("name") == name)
    ]


def running_pods(emulator: KubeEmulator) -> Alive:
    """Whether a lease id's pod runs (and is not being deleted), as the API holds it."""

    def alive(lease_id: str) -> bool:
        return any(
            p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
            for p in pods_of(emulator, lease_id)
        )

    return alive


def pod_deletes(emulator: KubeEmulator) -> Stopped:
    """When the lease's pod was first asked to be deleted, by the API server's record."""
    return lambda lease: min(
        (r["time"] for r in pod_calls(emulator, "delete", lease["provider_token"])), default=None
    )


# --- what a cloud provider shows, on Kubernetes as on Modal (test_modal_provider.py) ---


def leased_with_a_scene(sched: Scheduler, provider: str) -> dict[str, Any]:
    """A renderer lease of the owner "me" for 600 s, its env SCENE=intro (a value the
    provider must keep out of all it shows), served by `provider`."""
    lease = sched.lease(kind="renderer", owner_id="me", ttl_seconds=600, env={"SCENE": "intro"})
    assert lease["provider"] == provider
    return lease


def renewed_and_released(sched: Scheduler, lease: dict[str, Any]) -> None:
    """Its owner ("me") renews the lease to 900 s and releases it: the lease is then
    `released`, with its cost."""
    renewed = sched.http.post(
        f"/v1/lease/{lease['lease_id']}/renew",
        json={"ttl_seconds": 900},
        headers={"X-Lease-Owner": "me"},
    )
    assert renewed.status_code == 200, renewed.text
    assert sched.release(lease["lease_id"], owner="me").status_code == 204
    done = sched.http.get(f"/v1/lease/{lease['lease_id']}").json()
    assert done["state"] == "released" and done["cost"] is not None


def refuses_a_class_it_names_no_gpu_for(sched: Scheduler, setting: str) -> None:
    """A GPU class the provider's `setting` names nothing for (`high`) is not served
    there, and the answer says which setting."""
    refused = sched.acquire(kind="anim", gpu="high")
    assert refused.status_code == 503, refused.text
    assert setting in refused.json()["message"]


def bounded_by_the_worker_s_deadline(sched: Scheduler, setting: str) -> dict[str, Any]:
    """A lease lives at most its worker's deadline on the provider (`setting`, 120 s): a
    longer TTL is not served there, and a renewal past it is refused, saying when the
    worker goes. The lease (of 60 s) that is served."""
    too_long = sched.acquire(kind="renderer", ttl_seconds=600)
    assert too_long.status_code == 503, too_long.text
    assert setting in too_long.json()["message"]
    lease = sched.lease(kind="renderer", ttl_seconds=60)
    past = sched.http.post(f"/v1/lease/{lease['lease_id']}/renew", json={"ttl_seconds": 300})
    assert past.status_code == 409, past.text
    assert past.json()["error"] == "past_provider_deadline" and "deadline" in past.json()
    return lease


def killed_mid_create(sched: Scheduler, asked_for: Callable[[], Any], what: str) -> None:
    """A caller's acquire is under way when the scheduler is killed: as soon as
    `asked_for()` shows the provider was asked for the worker (`what`)."""

    def acquire() -> None:
        with contextlib.suppress(httpx.HTTPError):  # its scheduler is killed under it
            sched.acquire(kind="renderer", ttl_seconds=300)

    caller = threading.Thread(target=acquire, daemon=True)
    caller.start()
    wait_for(asked_for, 30, what=what)
    sched.kill()
    caller.join(30)


def shows_its_cap_of_two(sched: Scheduler, provider: str) -> None:
    """/v1/providers shows the provider healthy, with its cap of 2 workers (for each
    class), and 2 in use once two leases hold it; a third lease is refused, at the cap."""
    [view] = sched.http.get("/v1/providers").json()
    assert view["name"] == provider and view["healthy"], view
    assert view["max_workers"] == 2
    assert {gpu: use["capacity"] for gpu, use in view["gpu"].items()} == {"none": 2, "entry": 2}
    held = [sched.lease(kind="renderer", ttl_seconds=300) for _ in range(2)]
    view = sched.http.get("/v1/providers").json()[0]
    assert view["in_use"] == 2 and view["gpu"]["none"]["in_use"] == 2
    third = sched.acquire(kind="renderer", ttl_seconds=300)
    assert third.status_code == 503, third.text
    for lease in held:
        assert sched.release(lease["lease_id"]).status_code == 204


def the_guard_alone_ends_only_the_expired(
    sched: Scheduler, provider: str, alive: Alive, stopped: Stopped, **body: Any
) -> dict[str, Any]:
    """With the scheduler killed, its guard ends the worker of the lease that expired,
    within the bound and never early, and leaves the other's running
    (test_guard.py). `body`: what else the leases ask for. The lease that expired."""
    guard = GuardProcess(sched).start()
    try:
        short, long, last = leases_learned(sched, guard, provider, **body)
        sched.kill()
        only_the_expired_goes(alive, stopped, guard, short, long, last)
    finally:
        guard.kill()
    return short


def test_a_lease_on_kubernetes_is_a_pod_reached_at_its_ip(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, K8S_POD_DEADLINE_SECONDS="3600")
    lease = leased_with_a_scene(sched, "kubernetes")
    pod = pod_of(kube, lease)
    assert pod is not None and pod["status"]["phase"] == "Running"
    assert lease["endpoint"] == f"http://{pod['status']['podIP']}:8080"
    # The worker itself answers at its pod's IP, with its lease and the caller's env.
    page = httpx.get(lease["endpoint"] + "/", timeout=10).json()
    assert page["lease_id"] == lease["lease_id"] and page["fence"] == lease["fence"]
    assert lease["price_per_hour"] == 0.05 and lease["gpu_type"] is None

    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == 3600
    assert spec["automountServiceAccountToken"] is False
    labels = pod["metadata"]["labels"]
    assert labels["openalice.io/lease"] == lease["lease_id"]
    assert labels["openalice.io/instance"] == sched.instance
    assert labels["openalice.io/store"]
    # The env is in the Secret only, owned by the pod; the pod spec names the Secret.
    [container] = spec["containers"]
    assert "env" not in container and "intro" not in str(pod)
    assert container["envFrom"] == [{"secretRef": {"name": pod["metadata"]["name"]}}]
    [secret] = secrets_of(kube, lease["lease_id"])
    assert secret["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    env = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert env["SCENE"] == "intro" and env["LEASE_ID"] == lease["lease_id"]

    renewed_and_released(sched, lease)
    wait_for(lambda: gone(kube, lease), 30, what="the pod and its secret to go")
    # The kubeconfig's token is nowhere in the scheduler's log.
    assert kube.token not in sched.log()


def test_a_gpu_class_asks_for_its_resource_on_its_nodes(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube)
    lease = sched.lease(kind="anim", gpu="entry", ttl_seconds=300)
    pod = pod_of(kube, lease)
    assert pod is not None
    [container] = pod["spec"]["containers"]
    # The GPU as a limit; CPU and memory asked as much as they are limited (Guaranteed).
    sized = {"cpu": "1", "memory": "2Gi"}
    assert container["resources"] == {"limits": {**sized, "nvidia.com/gpu": "1"}, "requests": sized}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L4"}
    assert lease["gpu_type"] == "NVIDIA-L4" and lease["price_per_hour"] == 0.7
    refuses_a_class_it_names_no_gpu_for(sched, "K8S_GPU_CLASSES")
    assert sched.release(lease["lease_id"]).status_code == 204


def test_the_kubelet_ends_the_pod_at_its_deadline_with_no_scheduler_and_no_guard(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, K8S_POD_DEADLINE_SECONDS="120")
    guard = GuardProcess(sched).start()
    # A lease on Kubernetes lives at most the pod's deadline.
    lease = bounded_by_the_worker_s_deadline(sched, "K8S_POD_DEADLINE_SECONDS")

    sched.kill()
    guard.kill()  # neither the scheduler nor the guard runs
    pod = pod_of(kube, lease)
    assert pod is not None and pod["spec"]["activeDeadlineSeconds"] == 120
    assert pod["status"]["phase"] == "Running"
    assert kube.advance_clock(121) == [f"{NAMESPACE}/{pod['metadata']['name']}"]
    ended = pod_of(kube, lease)
    assert ended is not None and ended["status"]["phase"] == "Failed"
    assert ended["status"]["reason"] == "DeadlineExceeded"
    # Its container is stopped: the worker no longer runs.
    wait_for(
        lambda: all(
            c["state"] != "running"
            for c in kube.containers()
            if c["pod"] == pod["metadata"]["name"]
        ),
        30,
        what="the pod's container to stop",
    )


def test_an_unschedulable_pod_sends_the_acquire_to_the_next_provider(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(
        make_scheduler,
        kube,
        PROVIDERS="kubernetes,local-docker",
        K8S_SCHEDULE_TIMEOUT_SECONDS="1",
        LOCAL_DOCKER_MAX_WORKERS="1",
    )
    # The cluster's one L4 node has no GPU left.
    product = {"nvidia.com/gpu.product": "NVIDIA-L4"}
    kube.set_nodes(
        [
            {
                "name": "gpu-1",
                "labels": product,
                "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
            }
        ]
    )
    lease = sched.lease(kind="anim", gpu="none", ttl_seconds=300)
    assert lease["provider"] == "kubernetes"  # no GPU asked: it fits
    moved = sched.acquire(kind="anim", gpu="entry", ttl_seconds=300)
    # No node has the GPU: after the timeout the pod is deleted; Docker has no GPU either.
    assert moved.status_code == 503, moved.text
    message = moved.json()["message"]
    unschedulable = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    after = "after 1 s (K8S_SCHEDULE_TIMEOUT_SECONDS)"
    assert f"kubernetes: pod unschedulable {after}: {unschedulable}" in message, message
    wait_for(
        lambda: (
            [
                p
                for p in kube.pods(NAMESPACE)
                if p["metadata"]["labels"]["openalice.io/gpu"] == "entry"
            ]
            == []
        ),
        30,
        what="the unschedulable pod to be deleted",
    )
    # With no node at all, a CPU pod cannot be placed either: Docker serves it.
    kube.set_nodes([])
    elsewhere = sched.lease(kind="anim", gpu="none", ttl_seconds=300)
    assert elsewhere["provider"] == "local-docker"


def test_a_scheduler_killed_mid_create_leaves_one_pod_and_no_secret_behind(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, RECONCILE_INTERVAL_SECONDS="1")
    kube.pause_kubelet()  # the pod is made, its container waits
    killed_mid_create(sched, lambda: kube.secrets(NAMESPACE), "the pod and its secret made")
    [pod] = kube.pods(NAMESPACE)
    lease_id = pod["metadata"]["labels"]["openalice.io/lease"]
    kube.resume_kubelet()
    sched.start()
    # The restarted scheduler resolves the lease it was making; its pod and secret go.
    wait_for(lambda: not kube.pods(NAMESPACE), 60, what="the half-made pod to be deleted")
    wait_for(lambda: not kube.secrets(NAMESPACE), 30, what="its secret to be collected")
    leases = sched.http.get("/v1/leases", params={"state": ["failed", "released"]}).json()
    assert [(x["lease_id"], x["state"]) for x in leases] == [(lease_id, "failed")]
    assert len(pod_calls(kube, "create")) == 1  # one pod for the one lease, never two


def test_an_image_that_never_starts_fails_the_acquire_and_leaves_nothing(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    missing = "registry.invalid/openalice/missing:1"
    # A pull that keeps failing is given up after its bound (test_k8s_runtime.py: within it,
    # a pull that passes is waited out).
    sched = on_k8s(
        make_scheduler, kube, K8S_RENDERER_IMAGE=missing, K8S_IMAGE_PULL_TIMEOUT_SECONDS="2"
    )
    kube.set_unpullable([missing])
    failed = sched.acquire(kind="renderer", ttl_seconds=300)
    assert failed.status_code in (502, 503), failed.text
    assert "ErrImagePull" in failed.json()["message"] or "ImagePullBackOff" in failed.text
    assert "K8S_IMAGE_PULL_TIMEOUT_SECONDS" in failed.json()["message"]
    wait_for(lambda: not kube.pods(NAMESPACE) and not kube.secrets(NAMESPACE), 30, what="cleanup")


def test_api_errors_are_retried_and_make_one_pod(make_scheduler: Make, kube: KubeEmulator) -> None:
    sched = on_k8s(make_scheduler, kube)
    kube.fail_next(2, 503, verb="create", resource="pods")
    kube.fail_next(1, 429, verb="delete", resource="pods")
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert [r["code"] for r in pod_calls(kube, "create")] == [503, 503, 201]
    assert [p["metadata"]["name"] for p in kube.pods(NAMESPACE)] == [lease["provider_token"]]
    assert sched.release(lease["lease_id"]).status_code == 204
    assert [r["code"] for r in pod_calls(kube, "delete")] == [429, 200]
    wait_for(lambda: gone(kube, lease), 30, what="the pod to go")


def test_a_warm_pool_on_kubernetes_hands_its_pod_over(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, WARM_POOL="renderer/none=1")
    # Handed over at the pod's IP.
    handed_over_warm(sched, lambda held: httpx.get(held["endpoint"] + "/", timeout=10).json())
    wait_idle(sched, 1)  # the pool makes another pod


def test_kubernetes_shows_in_providers_and_k8s_max_pods_holds(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, K8S_MAX_PODS="2")
    shows_its_cap_of_two(sched, "kubernetes")
    # A Role without `list` shows as unhealthy, in the API's words.
    kube.set_rbac([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}])
    view = sched.http.get("/v1/providers").json()[0]
    assert not view["healthy"] and "403 Forbidden" in view["detail"], view
    assert 'cannot list resource "pods"' in view["detail"]


def test_the_guard_deletes_an_expired_lease_s_pod_when_the_scheduler_is_dead(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube)
    # Workers slow to stop: a pod deleted takes its whole grace period (3 s) to go, over
    # several of the guard's passes (0.5 s), which delete it once all the same.
    short = the_guard_alone_ends_only_the_expired(
        sched,
        "kubernetes",
        running_pods(kube),
        pod_deletes(kube),
        env={"STOP_DELAY_SECONDS": "60"},
    )
    assert len(pod_calls(kube, "delete", short["provider_token"])) == 1


def test_a_live_caller_preempts_an_anim_pod_deleted_with_its_grace_period(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, K8S_MAX_PODS="1", **PREEMPTING)
    victim = anim_preempted_for_live(sched, "kubernetes")
    # Deleted with the pod's own grace period (K8S_TERMINATION_GRACE_SECONDS), after
    # the notice: SIGTERM, then the kubelet's kill.
    [delete] = pod_calls(kube, "delete", victim["provider_token"])
    assert delete["grace_period"] == 3, delete
    wait_for(lambda: gone(kube, victim), 30, what="the victim's pod to go")


def test_an_orphan_pod_of_this_scheduler_is_deleted_and_others_are_left(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube, RECONCILE_INTERVAL_SECONDS="1")
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    from lightkube import Client, KubeConfig
    from lightkube.models.core_v1 import Container, PodSpec
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Pod

    client = Client(config=KubeConfig.from_file(kube.kubeconfig_path), namespace=NAMESPACE)

    def pod(name: str, instance: str) -> Pod:
        labels = {"openalice.io/instance": instance, "openalice.io/lease": str(uuid.uuid4())}
        # A worker that takes its whole grace period to stop (SIGTERM ignored: `sleep` is
        # the container's first process), so it is listed, terminating, for several passes.
        worker = Container(
            name="worker", image=WORKER_IMAGE, command=["/bin/busybox", "sleep", "600"]
        )
        spec = PodSpec(containers=[worker], terminationGracePeriodSeconds=3)
        return Pod(metadata=ObjectMeta(name=name, labels=labels), spec=spec)

    # A pod with this scheduler's labels and a lease its store never had, and one of
    # another instance, which is none of its business.
    client.create(pod("orphan", sched.instance))
    client.create(pod("someone-elses", "someone-else"))
    wait_for(lambda: kube.pod("orphan", NAMESPACE) is None, 60, what="the orphan to go")
    assert kube.pod("someone-elses", NAMESPACE) is not None
    assert pod_of(kube, lease) is not None
    # Deleted once and counted once, though passes went on while it took its grace period.
    assert len(pod_calls(kube, "delete", "orphan")) == 1
    assert (
        sched.metric("scheduler_leases_released_total", provider="kubernetes", reason="orphan") == 1
    )


def test_a_create_whose_answer_was_lost_finds_the_lease_s_one_pod(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube)
    # The API server makes the pod, and its answer is lost: the create is tried again,
    # answers 409, and the provider takes the pod of that name as the lease's own.
    kube.fail_next(1, 500, verb="create", resource="pods", after=True)
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert [r["code"] for r in pod_calls(kube, "create")] == [500, 409]
    assert [p["metadata"]["name"] for p in kube.pods(NAMESPACE)] == [lease["provider_token"]]
    assert httpx.get(lease["endpoint"] + "/", timeout=10).json()["lease_id"] == lease["lease_id"]


def test_the_code_uses_exactly_the_verbs_of_the_documented_role(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(
        make_scheduler, kube, RECONCILE_INTERVAL_SECONDS="1", K8S_SCHEDULE_TIMEOUT_SECONDS="1"
    )
    # Every call the provider makes: a create answered 409 (its first answer lost) is
    # followed by a read of the pod; the start is watched; reconciliation lists; a
    # release deletes the pod and its secret; an unschedulable pod's events are listed
    # (the cluster autoscaler's word on it).
    kube.fail_next(1, 500, verb="create", resource="pods", after=True)
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert sched.http.get("/v1/providers").json()[0]["healthy"]
    assert sched.release(lease["lease_id"]).status_code == 204
    wait_for(lambda: gone(kube, lease), 30, what="the pod to go")
    kube.set_nodes([{"name": "cpu-1", "allocatable": {"cpu": "8", "pods": "110"}}])
    assert sched.acquire(kind="renderer", gpu="entry", ttl_seconds=300).status_code == 503
    used = {(r["resource"], r["verb"]) for r in kube.requests()}
    granted = {
        (resource, verb)
        for rule in documented_role()["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert used == granted
    assert all(rule["apiGroups"] == [""] for rule in documented_role()["rules"])
    # Whatever the Role does not grant is refused: the emulator enforces it.
    assert not [r for r in kube.requests() if r["code"] == 403]


def test_a_pod_deleted_behind_the_scheduler_s_back_ends_its_lease_and_a_404_is_gone(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    sched = on_k8s(make_scheduler, kube)
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    from lightkube import Client, KubeConfig
    from lightkube.resources.core_v1 import Pod

    client = Client(config=KubeConfig.from_file(kube.kubeconfig_path), namespace=NAMESPACE)
    client.delete(Pod, lease["provider_token"], grace_period=0)
    wait_for(lambda: gone(kube, lease), 30, what="the pod and its secret to go")
    # The watch heard it: the lease ended `lost`. The scheduler's own delete of what
    # remained answered 404: the worker is gone, which is what was asked (no retry).
    lost(sched, lease, "unknown", None)
    assert sched.release(lease["lease_id"]).status_code == 404

    def deletes() -> list[int]:
        return [
            r["code"]
            for r in kube.requests()
            if r["verb"] == "delete" and r["name"] == lease["provider_token"]
        ]

    # The lease ends first, then what remains is deleted: waited for, not raced.
    wait_for(lambda: 404 in deletes(), 30, what="the scheduler's delete answered 404")


def test_k8s_gpu_classes_read_resource_count_and_node_labels() -> None:
    from openalice_scheduler.config.kubernetes import GpuRequest, parse_gpu_classes

    parsed = parse_gpu_classes(
        "entry=nvidia.com/gpu:1@nvidia.com/gpu.product=NVIDIA-L4@pool=spot, high=amd.com/gpu:2"
    )
    assert parsed == {
        "entry": GpuRequest(
            "nvidia.com/gpu", 1, {"nvidia.com/gpu.product": "NVIDIA-L4", "pool": "spot"}
        ),
        "high": GpuRequest("amd.com/gpu", 2, {}),
    }
    for bad, named in [
        ("entry=nvidia.com/gpu", "resource:count"),
        ("huge=nvidia.com/gpu:1", "'huge=nvidia.com/gpu:1'"),
        ("entry=nvidia.com/gpu:0", "at least 1"),
        ("entry=nvidia.com/gpu:1@product", "'product'"),
        ("entry=nvidia.com/gpu:1@a=b c", "'a=b c'"),
        ("entry=x:1,entry=y:1", "entry is given twice"),
    ]:
        with pytest.raises(ValueError, match=re.escape(named)):
            parse_gpu_classes(bad)
