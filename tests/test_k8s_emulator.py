"""The Kubernetes API emulator and its test kubelet, driven by lightkube (the provider's
client) through the kubeconfig the emulator writes: what is emulated is what lightkube
sends. Pods are real containers of the demo worker image."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import ssl
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import lightkube
import pytest
from lightkube import ApiError, AsyncClient, Client, KubeConfig
from lightkube.resources.core_v1 import Pod, Secret
from lightkube.types import PatchType

from tests import emulator_docker
from tests.emulator_docker import InstanceContainers
from tests.harness import WORKER_IMAGE, docker_client, wait_for
from tests.k8s_emulator import KubeEmulator
from tests.k8s_emulator.make_contract import CONTRACT, build, differs
from tests.oom import ATTEMPTS, oom_kill_docker_hears

NS = "openalice"


@pytest.fixture
def kube(kube_server: KubeEmulator) -> Iterator[KubeEmulator]:
    kube_server.reset()
    yield kube_server
    kube_server.reset()


@pytest.fixture
def client(kube: KubeEmulator) -> Client:
    return Client(KubeConfig.from_file(kube.kubeconfig_path))


def pod_body(name: str, **spec: Any) -> dict[str, Any]:
    labels = spec.pop("labels", {"app": "worker"})
    container = {
        "name": "worker",
        "image": WORKER_IMAGE,
        "ports": [{"containerPort": 8080}],
        **spec.pop("container", {}),
    }
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"restartPolicy": "Never", "containers": [container], **spec},
    }


def make_pod(client: Client, name: str, **spec: Any) -> Pod:
    return client.create(Pod.from_dict(pod_body(name, **spec)))


def raw(kube: KubeEmulator, token: str | None = None) -> httpx.Client:
    """An HTTP client of the API server as any other client would be (its CA, a token)."""
    context = ssl.create_default_context(cafile=kube.ca_file)
    return httpx.Client(
        base_url=kube.server_url,
        verify=context,
        headers={"Authorization": f"Bearer {token or kube.token}"},
    )


def phase(kube: KubeEmulator, name: str) -> str | None:
    pod = kube.pod(name)
    return pod["status"].get("phase") if pod else None


def waiting_reason(kube: KubeEmulator, name: str) -> str | None:
    pod = kube.pod(name) or {}
    statuses = pod.get("status", {}).get("containerStatuses") or [{}]
    return statuses[0].get("state", {}).get("waiting", {}).get("reason")


def ready(kube: KubeEmulator, name: str) -> bool:
    status = (kube.pod(name) or {}).get("status", {})
    return status.get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
    )


def condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in pod["status"].get("conditions", []) if c["type"] == kind)


def test_a_pod_waits_for_its_secret_then_serves_it_from_its_ip_and_is_deleted_gracefully(
    kube: KubeEmulator,
) -> None:
    async def scenario() -> dict[str, Any]:
        client = AsyncClient(KubeConfig.from_file(kube.kubeconfig_path))
        body = pod_body(
            "lease-1",
            labels={"app": "worker", "lease": "1"},
            terminationGracePeriodSeconds=5,
            container={
                "envFrom": [{"secretRef": {"name": "lease-1-env"}}],
                "env": [{"name": "WORKER_KIND", "value": "k8s-test"}],
                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}},
            },
        )
        created = await client.create(Pod.from_dict(body))
        assert created.metadata.uid and created.status.phase == "Pending"
        await asyncio.to_thread(
            wait_for,
            lambda: waiting_reason(kube, "lease-1") == "CreateContainerConfigError",
            15,
        )
        waiting = kube.pod("lease-1")["status"]["containerStatuses"][0]["state"]["waiting"]
        assert waiting["message"] == 'secret "lease-1-env" not found'
        owner = {"apiVersion": "v1", "kind": "Pod", "name": "lease-1", "uid": created.metadata.uid}
        secret = Secret.from_dict(
            {
                "metadata": {"name": "lease-1-env", "ownerReferences": [owner]},
                "stringData": {"LEASE_ID": "lease-1-id"},
            }
        )
        stored = await client.create(secret)
        assert stored.data == {"LEASE_ID": base64.b64encode(b"lease-1-id").decode()}
        assert stored.stringData is None
        await asyncio.to_thread(
            wait_for, lambda: ready(kube, "lease-1"), 30, what="the pod to be ready"
        )
        pod = await client.get(Pod, "lease-1")
        assert pod.status.phase == "Running" and any(
            c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []
        ), pod.status
        async with httpx.AsyncClient() as http:
            shown = (await http.get(f"http://{pod.status.podIP}:8080/", timeout=10)).json()
        answer = await client.delete(Pod, "lease-1", grace_period=3)
        assert answer is None  # lightkube drops the body; the pod is still there
        terminating = kube.pod("lease-1")
        await client.close()
        return {"pod": pod, "shown": shown, "terminating": terminating}

    result = asyncio.run(scenario())
    pod: Pod = result["pod"]
    assert result["shown"]["lease_id"] == "lease-1-id"
    assert result["shown"]["kind"] == "k8s-test"
    assert pod.spec.nodeName == "node-1" and pod.status.hostIP == kube.host_ip
    status = pod.status.containerStatuses[0]
    assert status.ready and status.restartCount == 0 and status.state.running.startedAt
    assert status.containerID.startswith("docker://") and status.image == WORKER_IMAGE
    terminating = result["terminating"]
    assert terminating["metadata"]["deletionTimestamp"]
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 3
    wait_for(lambda: kube.pod("lease-1") is None, 30, what="the pod removed")
    assert kube.secrets(NS) == []  # collected with its owner
    assert kube.containers() == []
    deletes = [r for r in kube.requests() if r["verb"] == "delete"]
    assert deletes == [
        {**deletes[0], "resource": "pods", "name": "lease-1", "code": 200, "grace_period": 3}
    ]


def test_label_selectors_duplicates_unknown_names_and_namespaces(
    kube: KubeEmulator, client: Client
) -> None:
    kube.pause_kubelet()  # objects only: no container needed
    make_pod(client, "a", labels={"app": "worker", "tier": "gpu"})
    make_pod(client, "b", labels={"app": "worker", "tier": "cpu"})
    make_pod(client, "c", labels={"app": "other"})

    def names(labels: Any) -> list[str]:
        return sorted(p.metadata.name for p in client.list(Pod, labels=labels))

    assert names({"app": "worker"}) == ["a", "b"]
    assert names({"app": "worker", "tier": "gpu"}) == ["a"]
    assert names({"tier": lightkube.operators.not_equal("gpu")}) == ["b", "c"]
    assert names({"tier": lightkube.operators.exists()}) == ["a", "b"]
    assert names({"tier": lightkube.operators.not_exists()}) == ["c"]
    assert names({"tier": lightkube.operators.in_(["gpu", "x"])}) == ["a"]
    assert names({"tier": lightkube.operators.not_in(["gpu"])}) == ["b", "c"]
    with raw(kube) as http:
        listed = http.get(f"/api/v1/namespaces/{NS}/pods", params={"labelSelector": "app"}).json()
    assert listed["kind"] == "PodList" and int(listed["metadata"]["resourceVersion"]) > 0
    assert [p["metadata"]["name"] for p in listed["items"]] == ["a", "b", "c"]

    with pytest.raises(ApiError) as duplicate:
        make_pod(client, "a")
    assert duplicate.value.status.code == 409
    assert duplicate.value.status.reason == "AlreadyExists"
    assert duplicate.value.status.message == 'pods "a" already exists'
    with pytest.raises(ApiError) as missing:
        client.delete(Pod, "nope")
    assert (missing.value.status.code, missing.value.status.message) == (
        404,
        'pods "nope" not found',
    )
    assert missing.value.status.details.kind == "pods"
    with pytest.raises(ApiError) as no_namespace:
        client.create(Pod.from_dict(pod_body("x")), namespace="ghost")
    assert no_namespace.value.status.message == 'namespaces "ghost" not found'
    kube.add_namespace("ghost")
    client.create(Pod.from_dict(pod_body("x")), namespace="ghost")
    other = Client(KubeConfig.from_file(kube.kubeconfig_path).get(context_name="other"))
    assert [p.metadata.name for p in other.list(Pod)] == []  # namespace default
    assert other.namespace == "default"


def test_unknown_fields_and_wrong_types_are_refused_as_the_strict_api_does(
    kube: KubeEmulator,
) -> None:
    body = pod_body("strict")
    body["spec"]["foo"] = 1
    body["spec"]["containers"][0]["bar"] = "x"
    with raw(kube) as http:
        refused = http.post(f"/api/v1/namespaces/{NS}/pods", json=body)
        body = pod_body("strict", activeDeadlineSeconds="ten")
        typed = http.post(f"/api/v1/namespaces/{NS}/pods", json=body)
        invalid = http.post(f"/api/v1/namespaces/{NS}/pods", json=pod_body("Bad_Name"))
    assert refused.status_code == 400
    assert refused.headers["content-type"] == "application/json"
    assert refused.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'strict decoding error: unknown field "spec.containers[0].bar", '
        'unknown field "spec.foo"',
        "reason": "BadRequest",
        "code": 400,
    }
    assert typed.status_code == 400 and "activeDeadlineSeconds of type int64" in typed.text
    assert invalid.status_code == 422 and invalid.json()["reason"] == "Invalid"
    assert kube.pods() == []


def test_contract_file_matches_the_installed_lightkube_models() -> None:
    contract = json.loads(CONTRACT.read_text())
    assert contract["x-source"]["taken"]  # the day it was taken
    assert contract["x-source"]["kubernetes"] == "v1.37"
    assert differs(contract, build()) == []
    changed = json.loads(CONTRACT.read_text())
    del changed["types"]["core_v1.PodSpec"]["fields"]["nodeSelector"]
    assert differs(changed, build())  # the check can fail


def test_scheduling_refusals_use_the_schedulers_words_and_are_retried(
    kube: KubeEmulator, client: Client
) -> None:
    kube.pause_kubelet()
    gpus = {"container": {"resources": {"limits": {"nvidia.com/gpu": "2"}}}}
    make_pod(client, "g1", **gpus)
    make_pod(client, "g2", **gpus)
    make_pod(client, "h100", nodeSelector={"nvidia.com/gpu.product": "NVIDIA-H100"})
    kube.sync()
    assert kube.pod("g1")["spec"]["nodeName"] == "node-1"
    assert condition(kube.pod("g1"), "PodScheduled")["status"] == "True"
    waiting = condition(kube.pod("g2"), "PodScheduled")
    assert (waiting["status"], waiting["reason"]) == ("False", "Unschedulable")
    assert waiting["message"] == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    assert kube.pod("g2")["status"]["phase"] == "Pending"
    assert condition(kube.pod("h100"), "PodScheduled")["message"] == (
        "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    )
    client.delete(Pod, "g1", grace_period=0)  # room again: g2 goes
    wait_for(lambda: kube.pod("g2")["spec"].get("nodeName") == "node-1", 10)
    node = {"allocatable": {"nvidia.com/gpu": "1", "pods": "10"}}
    kube.set_nodes(
        [
            {"name": "n1", **node},
            {"name": "n2", "labels": {"nvidia.com/gpu.product": "NVIDIA-H100"}, **node},
        ]
    )
    assert kube.pod("h100")["spec"]["nodeName"] == "n2"
    make_pod(client, "g3", **gpus)
    kube.sync()
    assert condition(kube.pod("g3"), "PodScheduled")["message"] == (
        "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    )


def test_an_unpullable_image_backs_off_and_nothing_runs(kube: KubeEmulator, client: Client) -> None:
    kube.set_unpullable([WORKER_IMAGE])
    make_pod(client, "nopull")
    wait_for(lambda: waiting_reason(kube, "nopull") == "ErrImagePull", 10)
    wait_for(lambda: waiting_reason(kube, "nopull") == "ImagePullBackOff", 10)
    assert phase(kube, "nopull") == "Pending"
    make_pod(client, "absent", container={"image": "openalice-no-such-image:1"})
    wait_for(lambda: waiting_reason(kube, "absent") == "ErrImagePull", 10)
    assert kube.containers() == []


def test_the_deadline_fails_the_pod_and_removes_its_container_after_a_clock_move(
    kube: KubeEmulator, client: Client
) -> None:
    make_pod(client, "timed", activeDeadlineSeconds=600, terminationGracePeriodSeconds=1)
    wait_for(lambda: phase(kube, "timed") == "Running", 30)
    assert kube.advance_clock(300) == []
    assert phase(kube, "timed") == "Running"
    assert kube.advance_clock(301) == [f"{NS}/timed"]
    status = client.get(Pod, "timed").status
    assert (status.phase, status.reason) == ("Failed", "DeadlineExceeded")
    assert status.message == "Pod was active on the node longer than the specified deadline"
    # advance_clock answers once the container is stopped and removed: no wait here.
    assert kube.containers() == []


def test_containers_that_exit_end_their_pods_without_restarts(
    kube: KubeEmulator, client: Client
) -> None:
    shell = ["/bin/busybox", "sh", "-c"]
    make_pod(client, "ok", container={"command": shell, "args": ["exit 0"]})
    make_pod(client, "bad", container={"command": [*shell, "exit 3"]})
    wait_for(lambda: phase(kube, "ok") == "Succeeded" and phase(kube, "bad") == "Failed", 30)
    bad = kube.pod("bad")["status"]["containerStatuses"][0]
    assert bad["state"]["terminated"]["exitCode"] == 3
    assert bad["state"]["terminated"]["reason"] == "Error"
    assert bad["restartCount"] == 0
    ok = kube.pod("ok")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (ok["exitCode"], ok["reason"]) == (0, "Completed")


def test_rbac_tokens_and_injected_faults_answer_real_statuses(
    kube: KubeEmulator, client: Client
) -> None:
    kube.set_rbac([{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "create"]}])
    kube.pause_kubelet()
    make_pod(client, "allowed")
    with pytest.raises(ApiError) as forbidden:
        list(client.list(Pod))
    assert forbidden.value.status.code == 403
    assert forbidden.value.status.message == (
        'pods is forbidden: User "system:serviceaccount:openalice:openalice-scheduler" '
        'cannot list resource "pods" in API group "" in the namespace "openalice"'
    )
    with pytest.raises(ApiError) as named:
        client.delete(Pod, "allowed")
    assert named.value.status.message.startswith('pods "allowed" is forbidden: User')
    kube.set_rbac(None)
    with raw(kube, token="wrong") as http:
        refused = http.get(f"/api/v1/namespaces/{NS}/pods")
    assert refused.status_code == 401 and refused.json()["reason"] == "Unauthorized"

    kube.fail_next(1, 429, verb="get", resource="pods", retry_after=2)
    with raw(kube) as http:
        limited = http.get(f"/api/v1/namespaces/{NS}/pods/allowed")
        again = http.get(f"/api/v1/namespaces/{NS}/pods/allowed")
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "2"
    assert limited.json()["details"] == {"retryAfterSeconds": 2}
    assert again.status_code == 200
    kube.fail_next(2, 503, verb="create")
    for _ in range(2):
        with pytest.raises(ApiError) as unavailable:
            make_pod(client, "later")
        assert unavailable.value.status.reason == "ServiceUnavailable"
    make_pod(client, "later")
    codes = [(r["verb"], r["code"]) for r in kube.requests()]
    assert codes.count(("create", 503)) == 2 and ("list", 403) in codes
    assert ("list", 401) in codes


def test_a_pod_update_may_only_lower_its_deadline_or_change_labels(
    kube: KubeEmulator, client: Client
) -> None:
    kube.pause_kubelet()
    make_pod(client, "p")
    patched = client.patch(Pod, "p", {"spec": {"activeDeadlineSeconds": 100}})
    assert patched.spec.activeDeadlineSeconds == 100
    merge = PatchType.MERGE
    lowered = client.patch(Pod, "p", {"spec": {"activeDeadlineSeconds": 50}}, patch_type=merge)
    assert lowered.spec.activeDeadlineSeconds == 50
    assert int(lowered.metadata.resourceVersion) > int(patched.metadata.resourceVersion)
    with pytest.raises(ApiError) as raised:
        client.patch(Pod, "p", {"spec": {"activeDeadlineSeconds": 200}})
    assert raised.value.status.code == 422
    assert raised.value.status.message == (
        'Pod "p" is invalid: spec.activeDeadlineSeconds: Invalid value: 200: '
        "must be less than or equal to previous value"
    )
    with pytest.raises(ApiError) as other:
        client.patch(Pod, "p", {"spec": {"restartPolicy": "Always"}})
    assert other.value.status.message.startswith(
        'Pod "p" is invalid: spec: Forbidden: pod updates may not change fields other than '
        "`spec.containers[*].image`"
    )
    labelled = client.patch(Pod, "p", {"metadata": {"labels": {"lease": "x"}}})
    assert labelled.metadata.labels == {"app": "worker", "lease": "x"}
    json_patch = [{"op": "replace", "path": "/spec/activeDeadlineSeconds", "value": 40}]
    assert (
        client.patch(Pod, "p", json_patch, patch_type=PatchType.JSON).spec.activeDeadlineSeconds
        == 40
    )


def test_a_watch_streams_the_changes_of_matching_pods(kube: KubeEmulator, client: Client) -> None:
    kube.pause_kubelet()

    async def scenario() -> list[tuple[str, str, str | None]]:
        watcher = AsyncClient(KubeConfig.from_file(kube.kubeconfig_path))
        seen: list[tuple[str, str, str | None]] = []

        async def follow() -> None:
            async for kind, pod in watcher.watch(Pod, labels={"lease": "w"}):
                seen.append((kind, pod.metadata.name, pod.metadata.deletionTimestamp and "set"))
                if kind == "DELETED":
                    return

        task = asyncio.create_task(follow())
        await asyncio.to_thread(
            wait_for, lambda: any(r["verb"] == "watch" for r in kube.requests()), 10
        )
        await asyncio.to_thread(make_pod, client, "w1", labels={"lease": "w"})
        await asyncio.to_thread(make_pod, client, "other", labels={"lease": "no"})
        await asyncio.to_thread(client.delete, Pod, "w1")
        await asyncio.wait_for(task, 20)
        await watcher.close()
        return seen

    seen = asyncio.run(scenario())
    assert [(kind, name) for kind, name, _ in seen][0] == ("ADDED", "w1")
    assert seen[-1][:2] == ("DELETED", "w1")
    assert all(name == "w1" for _, name, _ in seen)


def test_the_log_never_shows_the_token(kube: KubeEmulator, client: Client) -> None:
    kube.pause_kubelet()
    make_pod(client, "logged")
    assert kube.log_path is not None
    text = kube.log_path.read_text()
    assert "POST /api/v1/namespaces/openalice/pods -> 201" in text
    assert kube.token not in text


# --- deaths after hand-out, as a client watching pods sees them ---------------------------

Event = tuple[str, dict[str, Any]]
SHELL = ["/bin/busybox", "sh", "-c"]
# A container that does not listen, whose shell ignores SIGTERM: only a SIGKILL ends it.
DEAF = {"command": SHELL, "args": ["trap '' TERM; while :; do /bin/busybox sleep 1; done"]}


def watch_during(
    kube: KubeEmulator, labels: dict[str, str], act: Any, until: Any, timeout: float = 120
) -> tuple[list[Event], Any]:
    """Watch pods by `labels` with lightkube's AsyncClient, from the resourceVersion of a
    list (as a client that lists, then watches), while `act()` runs in a thread, until
    `until(events)` holds. The events (type, Pod as a dict) in order, and what `act`
    returned."""

    async def scenario() -> tuple[list[Event], Any]:
        client = AsyncClient(KubeConfig.from_file(kube.kubeconfig_path))
        seen: list[Event] = []
        listed = client.list(Pod, labels=labels)
        async for _ in listed:
            pass

        async def follow() -> None:
            async for kind, pod in client.watch(
                Pod, labels=labels, resource_version=listed.resourceVersion
            ):
                seen.append((kind, pod.to_dict()))
                if until(seen):
                    return

        def watches() -> int:
            return len([r for r in kube.requests() if r["verb"] == "watch"])

        before = watches()
        task = asyncio.create_task(follow())
        try:
            await asyncio.to_thread(wait_for, lambda: watches() > before, 30, what="the watch")
            result = await asyncio.to_thread(act)
            await asyncio.wait_for(task, timeout)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await client.close()
        return seen, result

    return asyncio.run(scenario())


def cond(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in pod["status"].get("conditions") or [] if c["type"] == kind), {})


def container_state(pod: dict[str, Any]) -> dict[str, Any]:
    return dict(pod["status"]["containerStatuses"][0]["state"])


def ended(name: str) -> Any:
    """`until` of watch_during: the pod `name` shows a terminal phase."""
    return lambda seen: any(
        p["metadata"]["name"] == name and p["status"].get("phase") in ("Succeeded", "Failed")
        for _, p in seen
    )


def last(seen: list[Event], name: str) -> dict[str, Any]:
    return [p for _, p in seen if p["metadata"]["name"] == name][-1]


def running_pod(kube: KubeEmulator, client: Client, name: str, **spec: Any) -> None:
    make_pod(client, name, **spec)
    wait_for(lambda: phase(kube, name) == "Running", 60, what=f"{name} running")


def test_a_pod_without_a_readiness_probe_is_ready_once_its_container_runs(
    kube: KubeEmulator, client: Client
) -> None:
    # It does not listen at all: without a probe, readiness is Success by default.
    labels = {"app": "worker", "case": "ready"}
    seen, _ = watch_during(
        kube,
        labels,
        lambda: make_pod(client, "quiet", labels=labels, container=DEAF),
        lambda seen: cond(seen[-1][1], "Ready").get("status") == "True",
        timeout=60,
    )
    assert seen[0][0] == "ADDED" and seen[-1][0] == "MODIFIED"
    ready = seen[-1][1]
    assert ready["status"]["phase"] == "Running"
    assert cond(ready, "ContainersReady")["status"] == "True"
    assert ready["status"]["containerStatuses"][0]["ready"] is True
    assert "running" in container_state(ready)


def test_containers_that_exit_are_seen_ended_on_a_watch_with_their_exit_codes(
    kube: KubeEmulator, client: Client
) -> None:
    labels = {"app": "worker", "case": "exit"}

    def start() -> None:
        make_pod(client, "zero", labels=labels, container={"command": [*SHELL, "exit 0"]})
        make_pod(client, "seven", labels=labels, container={"command": [*SHELL, "exit 7"]})

    seen, _ = watch_during(
        kube, labels, start, lambda seen: ended("zero")(seen) and ended("seven")(seen), 60
    )
    for name, code, reason, pod_phase in (
        ("zero", 0, "Completed", "Succeeded"),
        ("seven", 7, "Error", "Failed"),
    ):
        pod = last(seen, name)
        assert pod["status"]["phase"] == pod_phase
        state = container_state(pod)["terminated"]
        assert (state["exitCode"], state["reason"]) == (code, reason)
        assert state["containerID"].startswith("docker://") and state["finishedAt"]
        assert cond(pod, "Ready")["status"] == "False"
        assert "reason" not in pod["status"]
        # No event ever showed the terminal phase with the container still running.
        assert all(
            "running" not in container_state(p)
            for _, p in seen
            if p["metadata"]["name"] == name and p["status"].get("phase") == pod_phase
        )


def test_an_oom_kill_fails_the_pod_with_oomkilled_137(kube: KubeEmulator, client: Client) -> None:
    labels = {"app": "worker", "case": "oom"}
    running_pod(kube, client, "hog", labels=labels)
    seen, answered = watch_during(kube, labels, lambda: kube.oom_kill("hog"), ended("hog"))
    assert [kind for kind, _ in seen] == ["MODIFIED"]  # one change: the container's end
    pod = seen[-1][1]
    assert pod["status"]["phase"] == "Failed"
    assert "reason" not in pod["status"] and "message" not in pod["status"]
    state = container_state(pod)["terminated"]
    assert (state["reason"], state["exitCode"]) == ("OOMKilled", 137)
    assert pod["status"]["containerStatuses"][0]["ready"] is False
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert (cond(pod, "Ready")["status"], cond(pod, "Ready")["reason"]) == ("False", "PodFailed")
    assert cond(pod, "ContainersReady")["status"] == "False"
    assert cond(pod, "DisruptionTarget") == {}  # an OOM kill is no disruption
    assert answered["status"] == pod["status"]  # oom_kill answers once the pod shows it
    # Really killed; the ended container stays until the pod is deleted.
    assert [c["state"] for c in kube.containers()] == ["exited"]
    with pytest.raises(ValueError, match="409"):
        kube.oom_kill("hog")  # no longer running
    with pytest.raises(ValueError, match="404"):
        kube.oom_kill("nobody")


def test_a_container_past_its_memory_limit_is_oom_killed_for_real(
    kube: KubeEmulator, client: Client
) -> None:
    # busybox tail keeps the "line" it reads from /dev/zero: it grows until the kernel's
    # OOM killer ends it at the 16 MiB limit; Docker says OOMKilled, so does the pod.
    labels = {"app": "worker", "case": "real-oom"}
    container = {
        "command": ["/bin/busybox", "tail", "/dev/zero"],
        "resources": {"limits": {"memory": "16Mi"}},
    }
    made = iter(range(ATTEMPTS))

    def make() -> tuple[str, dict[str, Any]]:
        name = f"greedy-{next(made)}"
        seen, _ = watch_during(
            kube,
            labels,
            lambda: make_pod(client, name, labels=labels, container=container),
            ended(name),
        )
        pod = last(seen, name)
        assert pod["status"]["phase"] == "Failed"
        [ran] = [c["id"] for c in kube.containers() if c["pod"] == name]
        return ran, container_state(pod)["terminated"]

    def lost(state: dict[str, Any]) -> None:
        # Docker did not say OOMKilled (tests/oom.py): the kubelet says Error, as then.
        assert (state["reason"], state["exitCode"]) == ("Error", 137)

    state = oom_kill_docker_hears(make, lost)
    assert (state["reason"], state["exitCode"]) == ("OOMKilled", 137)


def test_a_die_that_comes_before_its_oom_is_reported_as_an_oom_kill_once_the_oom_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Docker may send a container's `die` before its `oom` (two goroutines of containerd's
    shim), and its `State.OOMKilled` then stays false: the test above once saw `Error` 137
    so on a loaded machine. That order cannot be made on purpose, so the two events are
    handed to the emulators' event reader as Docker sends them then, for a real container
    SIGKILLed (exit code 137, not marked OOM-killed). The `die` waits for the `oom` and is
    told an OOM kill, as containerd's CRI tells it; a SIGKILL with no `oom` is reported
    too, after OOM_LATE_SECONDS, as no OOM kill."""
    watcher = InstanceContainers("openalice.test.oom-order", uuid.uuid4().hex[:10], None, 60)
    engine = docker_client()
    try:
        killed = []
        for _ in range(2):
            made = engine.containers.run(
                WORKER_IMAGE, detach=True, labels={watcher.label: watcher.instance}
            )
            made.kill(signal="SIGKILL")
            assert made.wait(timeout=60)["StatusCode"] == 137
            made.reload()
            assert made.attrs["State"]["OOMKilled"] is False
            killed.append(made.id)
        reported: list[tuple[str, int, bool]] = []

        def on_die(labels: dict[str, str], container_id: str, code: int, oom: bool) -> None:
            reported.append((container_id, code, oom))

        def event(action: str, container_id: str) -> dict[str, Any]:
            attributes = {"exitCode": "137"} if action == "die" else {}
            return {"Action": action, "Actor": {"ID": container_id, "Attributes": attributes}}

        late, plain = killed
        watcher.heard(event("die", late), on_die)
        assert reported == []  # held: Docker has not said whether it was an OOM kill
        watcher.heard(event("oom", late), on_die)
        wait_for(lambda: reported, 30, what="the die, once its oom came")
        assert reported == [(late, 137, True)]

        monkeypatch.setattr(emulator_docker, "OOM_LATE_SECONDS", 0.2)
        watcher.heard(event("die", plain), on_die)
        wait_for(lambda: len(reported) == 2, 30, what="a plain SIGKILL's die")
        assert reported[1] == (plain, 137, False)
    finally:
        watcher.close()
    assert watcher.listed() == []


def test_a_node_pressure_eviction_fails_the_pod_as_the_kubelet_does(
    kube: KubeEmulator, client: Client
) -> None:
    labels = {"app": "worker", "case": "evict"}
    running_pod(kube, client, "deaf", labels=labels, container=DEAF)
    seen, answered = watch_during(kube, labels, lambda: kube.evict("deaf"), ended("deaf"))
    # One change, once the container has stopped: never Failed with it still running.
    assert [kind for kind, _ in seen] == ["MODIFIED"]
    pod = seen[-1][1]
    status = pod["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "Evicted")
    assert re.fullmatch(
        r"The node was low on resource: memory\. Threshold quantity: 100Mi, available: 50Mi\. "
        r"Container worker was using \d+(Ki|Mi)?, request is 0, has larger consumption of "
        r"memory\. ",
        status["message"],
    ), status["message"]
    disruption = cond(pod, "DisruptionTarget")
    assert (disruption["status"], disruption["reason"]) == ("True", "TerminationByKubelet")
    assert disruption["message"] == status["message"] and disruption["lastTransitionTime"]
    # SIGTERM ignored: the SIGKILL after the runtime's 2 s minimum ended it.
    state = container_state(pod)["terminated"]
    assert (state["exitCode"], state["reason"]) == (137, "Error")
    assert (cond(pod, "Ready")["status"], cond(pod, "Ready")["reason"]) == ("False", "PodFailed")
    assert answered["status"] == status
    assert [c["state"] for c in kube.containers()] == ["exited"]

    # A container that exits 0 at the SIGTERM (the demo worker does): since 1.27 the
    # kubelet gives the pod the phase its exit codes say, Succeeded, and drops the reason;
    # only DisruptionTarget tells the eviction.
    running_pod(kube, client, "polite", labels=labels)
    seen, _ = watch_during(kube, labels, lambda: kube.evict("polite"), ended("polite"))
    pod = last(seen, "polite")
    assert pod["status"]["phase"] == "Succeeded"
    assert "reason" not in pod["status"] and "message" not in pod["status"]
    assert cond(pod, "DisruptionTarget")["reason"] == "TerminationByKubelet"
    assert container_state(pod)["terminated"]["reason"] == "Completed"
    with pytest.raises(ValueError, match="400"):
        kube.evict("polite", resource="cpu")


def test_a_lost_node_has_its_pods_failed_and_deleted_by_the_pod_gc(
    kube: KubeEmulator, client: Client
) -> None:
    node = {"allocatable": {"cpu": "4", "memory": "8Gi", "pods": "10"}}
    kube.set_nodes([{"name": "vm-a", **node}, {"name": "vm-b", **node}])
    labels = {"app": "worker", "case": "lost"}
    for name in ("on-a", "on-b"):
        running_pod(
            kube,
            client,
            name,
            labels=labels,
            nodeSelector={"kubernetes.io/hostname": name.replace("on-", "vm-")},
        )

    seen, collected = watch_during(
        kube, labels, lambda: kube.lose_node("vm-a"), lambda seen: seen[-1][0] == "DELETED"
    )
    assert collected == [f"{NS}/on-a"]
    assert [(kind, p["metadata"]["name"]) for kind, p in seen] == [
        ("MODIFIED", "on-a"),
        ("DELETED", "on-a"),
    ]
    pod = seen[0][1]
    assert pod["status"]["phase"] == "Failed" and "reason" not in pod["status"]
    disruption = cond(pod, "DisruptionTarget")
    assert (disruption["status"], disruption["reason"], disruption["message"]) == (
        "True",
        "DeletionByPodGC",
        "PodGC: node no longer exists",
    )
    # Nothing else changed: no kubelet was left to report the container's end.
    assert "running" in container_state(pod)
    assert kube.pod("on-a") is None and phase(kube, "on-b") == "Running"
    assert [c["pod"] for c in kube.containers()] == ["on-b"]
    # The node is gone from scheduling, until it is back.
    make_pod(client, "for-a", labels=labels, nodeSelector={"kubernetes.io/hostname": "vm-a"})
    kube.sync()
    assert condition(kube.pod("for-a"), "PodScheduled")["message"] == (
        "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    )
    with pytest.raises(ValueError, match="404"):
        kube.lose_node("vm-a")
    kube.set_nodes([{"name": "vm-a", **node}, {"name": "vm-b", **node}])
    assert kube.pod("for-a")["spec"]["nodeName"] == "vm-a"


def test_the_deadline_is_seen_on_a_watch_ready_false_then_failed(
    kube: KubeEmulator, client: Client
) -> None:
    labels = {"app": "worker", "case": "deadline"}
    running_pod(
        kube,
        client,
        "late",
        labels=labels,
        activeDeadlineSeconds=600,
        terminationGracePeriodSeconds=1,  # the kubelet gives 2 s at least
        container=DEAF,
    )
    seen, ended_pods = watch_during(kube, labels, lambda: kube.advance_clock(600), ended("late"))
    assert ended_pods == [f"{NS}/late"]
    # First Ready turns False, the phase still Running; once the container has stopped
    # (SIGKILL after the grace period: it ignores SIGTERM), Failed, DeadlineExceeded.
    first, final = seen[0][1], seen[-1][1]
    assert first["status"]["phase"] == "Running"
    assert (cond(first, "Ready")["status"], cond(first, "Ready")["reason"]) == (
        "False",
        "PodFailed",
    )
    assert (final["status"]["phase"], final["status"]["reason"]) == ("Failed", "DeadlineExceeded")
    assert container_state(final)["terminated"]["exitCode"] == 137
    assert kube.containers() == []  # stopped and removed when advance_clock answered


def test_a_graceful_delete_shows_the_terminal_phase_then_deleted(
    kube: KubeEmulator, client: Client
) -> None:
    labels = {"app": "worker", "case": "delete"}
    running_pod(kube, client, "leaving", labels=labels)
    seen, _ = watch_during(
        kube,
        labels,
        lambda: client.delete(Pod, "leaving", grace_period=5),
        lambda seen: seen[-1][0] == "DELETED",
    )
    kinds = [kind for kind, _ in seen]
    assert kinds == ["MODIFIED", "MODIFIED", "DELETED"]
    assert seen[0][1]["metadata"]["deletionTimestamp"]
    # The worker exits 0 at SIGTERM: Succeeded, written before the object goes.
    assert seen[1][1]["status"]["phase"] == "Succeeded"
    assert container_state(seen[1][1])["terminated"]["reason"] == "Completed"
    assert kube.containers() == []


def test_watches_end_and_expire_as_the_api_server_ends_them(
    kube: KubeEmulator, client: Client
) -> None:
    kube.pause_kubelet()  # objects only
    labels = {"app": "worker", "case": "watch"}

    async def scenario() -> dict[str, Any]:
        watcher = AsyncClient(KubeConfig.from_file(kube.kubeconfig_path))
        seen: list[str] = []
        error: list[ApiError] = []

        async def follow() -> None:
            try:
                async for kind, pod in watcher.watch(Pod, labels=labels):
                    seen.append(f"{kind} {pod.metadata.name}")
            except ApiError as exc:
                error.append(exc)

        def watches() -> int:
            return len([r for r in kube.requests() if r["verb"] == "watch"])

        task = asyncio.create_task(follow())
        await asyncio.to_thread(wait_for, lambda: watches() == 1, 30, what="the watch")
        await asyncio.to_thread(make_pod, client, "w1", labels=labels)
        await asyncio.to_thread(wait_for, lambda: "ADDED w1" in seen, 30)
        ended_count = await asyncio.to_thread(kube.end_watches)
        # lightkube watches again from the last version it saw: nothing lost, no replay.
        await asyncio.to_thread(wait_for, lambda: watches() == 2, 30, what="a new watch")
        await asyncio.to_thread(make_pod, client, "w2", labels=labels)
        await asyncio.to_thread(wait_for, lambda: "ADDED w2" in seen, 30)
        expired_count = await asyncio.to_thread(kube.expire_watches)
        await asyncio.wait_for(task, 30)
        await watcher.close()
        return {"ended": ended_count, "expired": expired_count, "error": error, "seen": seen}

    result = asyncio.run(scenario())
    assert (result["ended"], result["expired"]) == (1, 1)
    assert [e for e in result["seen"] if e.startswith("ADDED")] == ["ADDED w1", "ADDED w2"]
    [error] = result["error"]
    assert (error.status.code, error.status.reason) == (410, "Expired")
    assert error.status.message == "The resourceVersion for the provided watch is too old."
    old = client.get(Pod, "w1").metadata.resourceVersion
    # A watch from a version now too old: 200, one ERROR event, the end.
    with raw(kube) as http:
        answer = http.get(
            f"/api/v1/namespaces/{NS}/pods",
            params={"watch": "true", "resourceVersion": old, "labelSelector": "case=watch"},
        )
    assert answer.status_code == 200
    [line] = answer.text.splitlines()
    event = json.loads(line)
    assert event["type"] == "ERROR"
    compacted = kube.state()["compacted"]
    assert event["object"] == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": f"too old resource version: {old} ({compacted})",
        "reason": "Expired",
        "code": 410,
    }
    with pytest.raises(ApiError) as too_old:
        next(iter(client.watch(Pod, labels=labels, resource_version=old)))
    assert too_old.value.status.code == 410
    # Listed again, a watch from the list's version serves the changes after it.
    listed = client.list(Pod, labels=labels)
    assert sorted(p.metadata.name for p in listed) == ["w1", "w2"]
    make_pod(client, "w3", labels=labels)
    kind, pod = next(
        iter(client.watch(Pod, labels=labels, resource_version=listed.resourceVersion))
    )
    assert (kind, pod.metadata.name) == ("ADDED", "w3")
