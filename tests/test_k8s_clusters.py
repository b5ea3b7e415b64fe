"""The pod as the clusters people run want it (issue 35), against the Kubernetes emulator:
GKE's labels and tainted GPU nodes, tolerations, Guaranteed QoS, the restricted Pod
Security level and its way out, a PriorityClass per lease class, image pull secrets, and
start-up refusing bad values of each. The emulator's own new rules (taints, Pod Security
and Priority admission, the kubelet's runAsNonRoot check) are tested here too
(docs/backends/kubernetes.md#the-pod-a-cluster-accepts)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import lightkube
import pytest
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Pod

from tests.harness import WORKER_IMAGE, Scheduler, printed_lines, wait_for
from tests.k8s_emulator import KubeEmulator
from tests.k8s_emulator.clusters import aks_gpu_node, cpu_node, gke_gpu_node
from tests.k8s_emulator.scheduling import validate_nodes
from tests.k8s_emulator.taints import tolerates, untolerated
from tests.test_k8s_provider import documented_role
from tests.test_lifecycle import serve, startable

Make = Callable[..., Scheduler]
ENFORCE = "pod-security.kubernetes.io/enforce"
GKE = [
    gke_gpu_node("gke-l4", "nvidia-l4"),
    gke_gpu_node("gke-a100", "nvidia-tesla-a100"),
    gke_gpu_node("gke-h100", "nvidia-h100-80gb"),
]


@pytest.fixture
def kube(kube_server: KubeEmulator) -> KubeEmulator:
    kube_server.reset()
    kube_server.set_rbac(documented_role()["rules"])
    return kube_server


def on_cluster(make_scheduler: Make, emulator: KubeEmulator, **env: str) -> Scheduler:
    """The scheduler on the emulated cluster with the defaults a new user has: no
    K8S_GPU_CLASSES, no K8S_TOLERATIONS, no security settings."""
    settings = {
        "PROVIDERS": "kubernetes",
        "KUBECONFIG": str(emulator.kubeconfig_path),
        "K8S_RENDERER_IMAGE": WORKER_IMAGE,
        "K8S_ANIM_IMAGE": WORKER_IMAGE,
        "K8S_PRICE_PER_HOUR": "0.5",
        "K8S_TERMINATION_GRACE_SECONDS": "3",
        "RENDERER_READY_PATH": "/healthz",
        "ANIM_READY_PATH": "/healthz",
    }
    return make_scheduler(**{**settings, **env})


def pod_of(emulator: KubeEmulator, lease: dict[str, Any], namespace: str) -> dict[str, Any]:
    found = emulator.pod(lease["provider_token"], namespace)
    assert found is not None, lease
    return found


def no_pods_left(emulator: KubeEmulator, namespace: str) -> None:
    wait_for(lambda: emulator.pods(namespace) == [], 60, what="no pod left behind")
    wait_for(lambda: emulator.secrets(namespace) == [], 60, what="no secret left behind")


# --- GPU nodes: labels and taints ------------------------------------------------------


def test_with_only_k8s_gpu_labels_gke_every_gpu_class_lands_on_gkes_tainted_gpu_nodes(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    kube.set_nodes(GKE)
    sched = on_cluster(make_scheduler, kube, K8S_GPU_LABELS="gke")
    for gpu, node, accelerator in [
        ("entry", "gke-l4", "nvidia-l4"),
        ("mid", "gke-a100", "nvidia-tesla-a100"),
        ("high", "gke-h100", "nvidia-h100-80gb"),
    ]:
        lease = sched.lease(kind="renderer", gpu=gpu, ttl_seconds=300)
        assert lease["provider"] == "kubernetes"
        assert lease["gpu_type"] == accelerator
        pod = pod_of(kube, lease, "openalice")
        assert pod["spec"]["nodeName"] == node
        assert pod["spec"]["nodeSelector"] == {"cloud.google.com/gke-accelerator": accelerator}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
            "spec"
        ]["tolerations"]
        assert httpx.get(lease["endpoint"], timeout=30).status_code == 200


def test_the_default_labels_on_gke_are_refused_in_the_schedulers_words(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    """What a new user met on GKE before K8S_GPU_LABELS (issue 35): the GPU Operator's
    labels match no GKE node; now said after K8S_SCHEDULE_TIMEOUT_SECONDS."""
    kube.set_nodes([GKE[0]])
    sched = on_cluster(make_scheduler, kube, K8S_SCHEDULE_TIMEOUT_SECONDS="1")
    refused = sched.acquire(kind="renderer", gpu="entry", ttl_seconds=300)
    assert refused.status_code == 503, refused.text
    assert (
        "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
        in refused.json()["message"]
    )
    no_pods_left(kube, "openalice")


def test_without_its_toleration_a_pod_is_kept_off_a_tainted_node_and_with_it_lands(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    kube.set_nodes([aks_gpu_node("aks-gpu")])
    # AKS's GPU pools carry sku=gpu:NoSchedule, which the default tolerations do not name.
    sched = on_cluster(
        make_scheduler, kube, K8S_GPU_LABELS="none", K8S_SCHEDULE_TIMEOUT_SECONDS="1"
    )
    refused = sched.acquire(kind="renderer", gpu="entry", ttl_seconds=300)
    assert refused.status_code == 503, refused.text
    assert (
        "0/1 nodes are available: 1 node(s) had untolerated taint {sku: gpu}."
        in refused.json()["message"]
    ), refused.text
    no_pods_left(kube, "openalice")
    sched.stop()
    sched = on_cluster(
        make_scheduler,
        kube,
        K8S_GPU_LABELS="none",
        K8S_TOLERATIONS="entry=sku=gpu:NoSchedule@nvidia.com/gpu:NoSchedule",
    )
    lease = sched.lease(kind="renderer", gpu="entry", ttl_seconds=300)
    pod = pod_of(kube, lease, "openalice")
    assert pod["spec"]["nodeName"] == "aks-gpu"
    assert pod["spec"]["tolerations"] == [
        {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    ]


# --- requests, security, priority, pull secrets -----------------------------------------


def test_a_restricted_namespace_takes_the_pods_guaranteed_and_non_root(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    namespace = f"strict-{uuid.uuid4().hex[:6]}"
    kube.add_namespace(namespace, {ENFORCE: "restricted"})
    kube.set_nodes([cpu_node("cpu-1"), *GKE])
    sched = on_cluster(
        make_scheduler,
        kube,
        K8S_NAMESPACE=namespace,
        K8S_GPU_LABELS="gke",
        K8S_RENDERER_CPU="2",
        K8S_RENDERER_MEMORY="3Gi",
        K8S_IMAGE_PULL_SECRETS="regcred, mirror-cred",
    )
    for kind, gpu in [("renderer", "entry"), ("anim", "none")]:
        lease = sched.lease(kind=kind, gpu=gpu, ttl_seconds=300)
        assert httpx.get(lease["endpoint"], timeout=30).status_code == 200  # it runs
        pod = pod_of(kube, lease, namespace)
        spec, container = pod["spec"], pod["spec"]["containers"][0]
        assert pod["status"]["qosClass"] == "Guaranteed"
        sized = (
            {"cpu": "2", "memory": "3Gi"} if kind == "renderer" else {"cpu": "1", "memory": "2Gi"}
        )
        assert container["resources"]["requests"] == sized
        gpu_limit = {"nvidia.com/gpu": "1"} if gpu == "entry" else {}
        assert container["resources"]["limits"] == {**sized, **gpu_limit}
        assert spec["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
        assert spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror-cred"}]
        assert "priorityClassName" not in spec


def test_baseline_is_the_way_out_for_a_root_image_and_restricted_refuses_it(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    strict, lax = (f"{level}-{uuid.uuid4().hex[:6]}" for level in ("strict", "lax"))
    kube.add_namespace(strict, {ENFORCE: "restricted"})
    kube.add_namespace(lax, {ENFORCE: "baseline"})
    # The image's own user (root, for the demo worker) under restricted: the kubelet
    # refuses to start it, and the acquire says why at once.
    sched = on_cluster(make_scheduler, kube, K8S_NAMESPACE=strict, K8S_RUN_AS_USER="image")
    refused = sched.acquire(kind="anim", gpu="none", ttl_seconds=300)
    assert refused.status_code in (502, 503), refused.text
    assert "container has runAsNonRoot and image will run as root" in refused.text
    assert "K8S_RUN_AS_USER" in refused.text
    no_pods_left(kube, strict)
    sched.stop()
    # baseline: a pod the restricted namespace refuses at admission...
    sched = on_cluster(make_scheduler, kube, K8S_NAMESPACE=strict, K8S_POD_SECURITY="baseline")
    refused = sched.acquire(kind="anim", gpu="none", ttl_seconds=300)
    assert refused.status_code in (502, 503), refused.text
    assert 'is forbidden: violates PodSecurity \\"restricted:latest\\"' in refused.text
    no_pods_left(kube, strict)
    sched.stop()
    # ... and a baseline namespace runs, as the image's own user.
    sched = on_cluster(make_scheduler, kube, K8S_NAMESPACE=lax, K8S_POD_SECURITY="baseline")
    lease = sched.lease(kind="anim", gpu="none", ttl_seconds=300)
    pod = pod_of(kube, lease, lax)
    assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert "securityContext" not in pod["spec"]["containers"][0]
    assert httpx.get(lease["endpoint"], timeout=30).status_code == 200


def test_a_lease_class_names_its_pods_priority_class(
    make_scheduler: Make, kube: KubeEmulator
) -> None:
    kube.add_priority_class("openalice-live", 100000)
    sched = on_cluster(
        make_scheduler,
        kube,
        PRIORITY_CLASSES="live=100:preempts,default=50,batch=10",
        UNLISTED_OWNER_MAX_CLASS="live",
        K8S_PRIORITY_CLASS_NAMES="live=openalice-live, batch=openalice-batch",
    )
    live = sched.lease(kind="anim", gpu="none", ttl_seconds=300, priority_class="live")
    pod = pod_of(kube, live, "openalice")
    assert pod["spec"]["priorityClassName"] == "openalice-live"
    assert pod["spec"]["priority"] == 100000  # the cluster's admission resolved it
    plain = sched.lease(kind="anim", gpu="none", ttl_seconds=300)
    assert "priorityClassName" not in pod_of(kube, plain, "openalice")["spec"]
    # A PriorityClass the cluster lacks: refused by its admission, said, nothing left.
    refused = sched.acquire(kind="anim", gpu="none", ttl_seconds=300, priority_class="batch")
    assert refused.status_code in (502, 503), refused.text
    assert "no PriorityClass with name openalice-batch was found" in refused.text
    assert sched.release(live["lease_id"]).status_code == 204
    assert sched.release(plain["lease_id"]).status_code == 204
    no_pods_left(kube, "openalice")


# --- bad settings -------------------------------------------------------------------------


def test_bad_pod_settings_stop_start_up_with_one_line_naming_the_variable(
    tmp_path: Path,
) -> None:
    valid = startable(tmp_path, LOCAL_GPU_DEVICES="")
    cases = [
        ("K8S_GPU_LABELS", "eks", "'gpu-operator', 'gke' or 'none'"),
        ("K8S_TOLERATIONS", "entry=nvidia.com/gpu:Never", "'nvidia.com/gpu:Never'"),
        ("K8S_TOLERATIONS", "gpu=nvidia.com/gpu", "'gpu=nvidia.com/gpu'"),
        ("K8S_RENDERER_CPU", "two", "'two'"),
        ("K8S_ANIM_MEMORY", "0Gi", "'0Gi'"),
        ("K8S_POD_SECURITY", "privileged", "'restricted' or 'baseline'"),
        ("K8S_RUN_AS_USER", "0", "'0'"),
        ("K8S_PRIORITY_CLASS_NAMES", "live=Not_A_Name", "'live=Not_A_Name'"),
        ("K8S_IMAGE_PULL_SECRETS", "ok,Bad Name", "'Bad Name'"),
        ("K8S_PRIORITY_CLASS_NAMES", "live=openalice-live", "no class 'live' in PRIORITY_CLASSES"),
    ]
    for variable, value, named in cases:
        result = serve(tmp_path, {**valid, variable: value})
        lines = printed_lines(result.stderr)
        assert result.returncode != 0, (variable, result.stderr)
        assert len(lines) == 1, (variable, result.stderr)
        assert variable in lines[0] and named in lines[0], (variable, lines)
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "cfg.db").exists()


# --- the emulator's own rules --------------------------------------------------------------


def test_the_toleration_rule_is_kubernetes_own() -> None:
    gpu = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    cases = [
        ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}, True),
        ({"key": "nvidia.com/gpu", "operator": "Exists"}, True),  # every effect
        ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}, True),
        ({"key": "nvidia.com/gpu", "value": "present"}, True),  # Equal is the default
        ({"key": "nvidia.com/gpu", "operator": "Equal", "value": "other"}, False),
        ({"key": "nvidia.com/gpu"}, False),  # Equal to an empty value
        ({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}, False),
        ({"operator": "Exists"}, True),  # an empty key with Exists: every taint
        ({"operator": "Exists", "effect": "NoExecute"}, False),
        ({"key": "sku", "operator": "Exists"}, False),
    ]
    for toleration, expected in cases:
        assert tolerates(toleration, gpu) is expected, toleration
    prefer = {"key": "spot", "value": "true", "effect": "PreferNoSchedule"}
    assert untolerated([prefer], []) is None  # only scores the node lower
    assert untolerated([prefer, gpu], []) == gpu
    # A node's taints, as --nodes and set_nodes take them, are checked.
    [node] = validate_nodes([gke_gpu_node("g", "nvidia-l4")])
    assert node["taints"] == [gpu]
    with pytest.raises(ValueError, match="effect"):
        validate_nodes([{"name": "n", "taints": [{"key": "k", "effect": "Sometimes"}]}])


def lightkube_client(kube: KubeEmulator) -> lightkube.Client:
    return lightkube.Client(lightkube.KubeConfig.from_file(kube.kubeconfig_path), trust_env=False)


def bare_pod(name: str, **spec: Any) -> Pod:
    return Pod.from_dict(
        {
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "worker", "image": WORKER_IMAGE}], **spec},
        }
    )


def test_the_emulator_admits_as_a_cluster_pod_security_and_priority_classes(
    kube: KubeEmulator,
) -> None:
    kube.set_rbac(None)
    namespace = f"strict-{uuid.uuid4().hex[:6]}"
    kube.add_namespace(namespace, {ENFORCE: "restricted"})
    client = lightkube_client(kube)
    with pytest.raises(ApiError) as refused:
        client.create(bare_pod("plain"), namespace=namespace)
    assert refused.value.status.code == 403
    assert refused.value.status.message == (
        'pods "plain" is forbidden: violates PodSecurity "restricted:latest": '
        'allowPrivilegeEscalation != false (container "worker" must set '
        "securityContext.allowPrivilegeEscalation=false), unrestricted capabilities "
        '(container "worker" must set securityContext.capabilities.drop=["ALL"]), '
        'runAsNonRoot != true (pod or container "worker" must set '
        "securityContext.runAsNonRoot=true), seccompProfile (pod or container "
        '"worker" must set securityContext.seccompProfile.type to "RuntimeDefault" or '
        '"Localhost")'
    )
    assert kube.pods(namespace) == []
    # The same pod in a namespace with no level: admitted (privileged).
    client.create(bare_pod("plain"), namespace="default")
    with pytest.raises(ApiError) as unknown:
        client.create(bare_pod("classy", priorityClassName="nope"), namespace="default")
    assert unknown.value.status.code == 403
    assert unknown.value.status.message == (
        'pods "classy" is forbidden: no PriorityClass with name nope was found'
    )
    made = client.create(
        bare_pod("critical", priorityClassName="system-cluster-critical"), namespace="default"
    )
    assert made.spec is not None and made.spec.priority == 2000000000
    # Tolerations the API's validation refuses.
    with pytest.raises(ApiError) as invalid:
        client.create(
            bare_pod(
                "tolerant",
                tolerations=[
                    {"operator": "Equal", "value": "x"},
                    {"key": "k", "operator": "Exists", "value": "v"},
                ],
            ),
            namespace="default",
        )
    assert invalid.value.status.code == 422
    message = invalid.value.status.message or ""
    assert "spec.tolerations[0].operator: Invalid value" in message
    assert "operator must be Exists when `key` is empty" in message
    assert "value must be empty when `operator` is 'Exists'" in message


def test_the_emulators_kubelet_refuses_a_root_image_under_run_as_non_root(
    kube: KubeEmulator,
) -> None:
    kube.set_rbac(None)
    client = lightkube_client(kube)
    client.create(bare_pod("rooted", securityContext={"runAsNonRoot": True}), namespace="default")

    def waiting() -> dict[str, Any] | None:
        pod = kube.pod("rooted", "default") or {}
        for status in pod.get("status", {}).get("containerStatuses") or []:
            return (status.get("state") or {}).get("waiting")
        return None

    # (ContainerCreating first, as the kubelet gets to it.)
    wait_for(
        lambda: (waiting() or {}).get("reason") == "CreateContainerConfigError",
        60,
        what="the kubelet's refusal",
    )
    state = waiting()
    assert state is not None
    assert state["message"].startswith("container has runAsNonRoot and image will run as root")
    # With a numeric non-root user it starts.
    client.create(
        bare_pod("numbered", securityContext={"runAsNonRoot": True, "runAsUser": 65532}),
        namespace="default",
    )
    wait_for(
        lambda: (kube.pod("numbered", "default") or {}).get("status", {}).get("phase") == "Running",
        60,
        what="the non-root pod to run",
    )


def test_tolerations_and_label_presets_read_as_documented() -> None:
    from openalice_scheduler.config.kubernetes import parse_gpu_classes
    from openalice_scheduler.config.kubernetes_pods import (
        Toleration,
        parse_tolerations,
        with_gpu_labels,
    )

    assert parse_tolerations(
        "entry=sku=gpu:NoSchedule@nvidia.com/gpu, none=*, high=a:NoExecute"
    ) == {
        "entry": [
            Toleration("sku", "Equal", "gpu", "NoSchedule"),
            Toleration("nvidia.com/gpu", "Exists", None, None),
        ],
        "none": [Toleration(None, "Exists", None, None)],
        "high": [Toleration("a", "Exists", None, "NoExecute")],
    }
    assert parse_tolerations("") == {}
    # A class's own labels in K8S_GPU_CLASSES win over the preset; the others get it.
    classes = parse_gpu_classes(
        "entry=nvidia.com/gpu:1,mid=nvidia.com/gpu:2@cloud.google.com/gke-accelerator=nvidia-a100-80gb"
    )
    labelled = with_gpu_labels(classes, "gke")
    assert labelled["entry"].node_selector == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert labelled["mid"].node_selector == {"cloud.google.com/gke-accelerator": "nvidia-a100-80gb"}
    assert labelled["mid"].count == 2 and "high" not in labelled
    assert with_gpu_labels(classes, "none")["entry"].node_selector == {}
