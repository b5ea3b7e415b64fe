"""The Kubernetes API emulator and its test kubelet, driven by lightkube (the provider's
client) through the kubeconfig the emulator writes: what is emulated is what lightkube
sends. Pods are real containers of the demo worker image."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import Iterator
from typing import Any

import httpx
import lightkube
import pytest
from lightkube import ApiError, AsyncClient, Client, KubeConfig
from lightkube.resources.core_v1 import Pod, Secret
from lightkube.types import PatchType

from tests.harness import WORKER_IMAGE, wait_for
from tests.k8s_emulator import KubeEmulator
from tests.k8s_emulator.make_contract import CONTRACT, build, differs

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
        for _ in range(300):
            pod = await client.get(Pod, "lease-1")
            if pod.status.phase == "Running" and any(
                c.type == "Ready" and c.status == "True" for c in pod.status.conditions or []
            ):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"never ready: {pod.status}")
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
    wait_for(lambda: kube.containers() == [], 15, what="the container removed")


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
