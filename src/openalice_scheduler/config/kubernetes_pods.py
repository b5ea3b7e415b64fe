"""What a cluster asks of a pod, as settings
(docs/backends/kubernetes.md#the-pod-a-cluster-accepts): the GPU nodes' labels per
cluster kind, the tolerations of their taints, CPU and memory requests equal to limits
(Guaranteed QoS), the Pod Security level the pod passes, the PriorityClass per lease
class, and the image pull secrets."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings

from openalice_scheduler.config.kubernetes import GpuRequest

# The node labels of each GPU class, per cluster kind. gpu-operator: the product label of
# NVIDIA's GPU feature discovery (the GPU Operator, and EKS/AKS with it). gke: the label
# GKE puts on every GPU node, its accelerator type
# (https://cloud.google.com/kubernetes-engine/docs/how-to/gpus: nvidia-l4, nvidia-tesla-a100,
# nvidia-h100-80gb, ...; GKE has no L40S, so `mid` is the A100 40GB).
GPU_LABEL_PRESETS: dict[str, dict[str, dict[str, str]]] = {
    "gpu-operator": {
        "entry": {"nvidia.com/gpu.product": "NVIDIA-L4"},
        "mid": {"nvidia.com/gpu.product": "NVIDIA-L40S"},
        "high": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    },
    "gke": {
        "entry": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
        "mid": {"cloud.google.com/gke-accelerator": "nvidia-tesla-a100"},
        "high": {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
    },
    "none": {},
}
# The taint GPU nodes carry on EKS's GPU AMIs, GKE and the GPU Operator's nodes
# (`nvidia.com/gpu` with effect NoSchedule), tolerated by every GPU class unless
# K8S_TOLERATIONS says otherwise.
K8S_DEFAULT_TOLERATIONS = (
    "entry=nvidia.com/gpu:NoSchedule,mid=nvidia.com/gpu:NoSchedule,high=nvidia.com/gpu:NoSchedule"
)
_CLASSES = ("none", "entry", "mid", "high")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")
# A DNS-1123 subdomain: the names of Secrets and PriorityClasses.
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Kubernetes' quantities, as a request is written: CPU in cores or millicores, memory in
# bytes with a decimal or binary suffix
# (https://kubernetes.io/docs/concepts/configuration/manage-resources-containers/#resource-units-in-kubernetes).
_CPU = re.compile(r"([0-9]+(\.[0-9]{1,3})?|[0-9]+m)")
_MEMORY = re.compile(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")


class KubernetesPodSettings(BaseSettings):
    """What the clusters people run ask of a pod
    (docs/backends/kubernetes.md#the-pod-a-cluster-accepts): the GPU nodes' labels, the
    tolerations of their taints, requests equal to limits (Guaranteed QoS), the Pod
    Security level, the PriorityClass per lease class, the image pull secrets."""

    k8s_gpu_labels: Literal["gpu-operator", "gke", "none"] = Field(
        "gpu-operator",
        description="The node labels of each GPU class, per kind of cluster: gpu-operator "
        "(nvidia.com/gpu.product, NVIDIA's GPU feature discovery), gke "
        "(cloud.google.com/gke-accelerator: nvidia-l4, nvidia-tesla-a100, nvidia-h100-80gb) "
        "or none; a class given @labels in K8S_GPU_CLASSES uses those instead.",
    )
    k8s_tolerations: str = Field(
        K8S_DEFAULT_TOLERATIONS,
        description="Per class, the taints its pods tolerate: "
        "class=key[=value][:Effect][@key...], comma separated (key alone: any value; "
        "no effect: every effect; * : every taint); empty: none.",
    )
    k8s_renderer_cpu: str = Field(
        "1", description="The renderer pod's CPU request and limit (cores, or millicores: 500m)."
    )
    k8s_renderer_memory: str = Field(
        "2Gi", description="The renderer pod's memory request and limit (e.g. 2Gi, 512Mi)."
    )
    k8s_anim_cpu: str = Field("1", description="The anim pod's CPU request and limit.")
    k8s_anim_memory: str = Field("2Gi", description="The anim pod's memory request and limit.")
    k8s_pod_security: Literal["restricted", "baseline"] = Field(
        "restricted",
        description="The Pod Security level the pods pass: restricted (non-root, no "
        "privilege escalation, every capability dropped, RuntimeDefault seccomp) or "
        "baseline (RuntimeDefault seccomp only: for images that must run as root).",
    )
    k8s_run_as_user: str = Field(
        "65532",
        description="Under restricted, the user id the container runs as (a number >= 1), "
        "or `image`: the image's own user, which must then be a numeric non-root one.",
    )
    k8s_priority_class_names: str = Field(
        "",
        description="The PriorityClass of a lease's pod by the lease's priority class: "
        "class=PriorityClass, comma separated; a class not named: none.",
    )
    k8s_image_pull_secrets: str = Field(
        "",
        description="Secrets in K8S_NAMESPACE the kubelet pulls the images with "
        "(imagePullSecrets), comma separated.",
    )

    @field_validator("k8s_tolerations")
    @classmethod
    def _tolerations(cls, value: str) -> str:
        parse_tolerations(value)
        return value

    @field_validator("k8s_renderer_cpu", "k8s_anim_cpu")
    @classmethod
    def _cpu(cls, value: str) -> str:
        if not _CPU.fullmatch(value.strip()) or _zero(value):
            raise ValueError(f"{value[:40]!r} is not a CPU amount above 0 (e.g. 2, 1.5, 500m)")
        return value.strip()

    @field_validator("k8s_renderer_memory", "k8s_anim_memory")
    @classmethod
    def _memory(cls, value: str) -> str:
        if not _MEMORY.fullmatch(value.strip()) or _zero(value):
            raise ValueError(f"{value[:40]!r} is not a memory amount above 0 (e.g. 2Gi, 512Mi)")
        return value.strip()

    @field_validator("k8s_run_as_user")
    @classmethod
    def _user(cls, value: str) -> str:
        value = value.strip()
        if value != "image" and not (value.isdigit() and 1 <= int(value) <= 2**31 - 1):
            raise ValueError(f"{value[:40]!r} is not a user id >= 1 (not root) or `image`")
        return value

    @field_validator("k8s_priority_class_names")
    @classmethod
    def _priority_classes(cls, value: str) -> str:
        parse_priority_class_names(value)
        return value

    @model_validator(mode="after")
    def _priority_classes_known(self) -> KubernetesPodSettings:
        # The lease classes are PRIORITY_CLASSES' (priorities.py), in the same Settings.
        table = getattr(self, "priority_table", None)
        if table is None:
            return self
        for cls in parse_priority_class_names(self.k8s_priority_class_names):
            if cls not in table:
                raise ValueError(
                    f"K8S_PRIORITY_CLASS_NAMES: no class {cls[:32]!r} in PRIORITY_CLASSES; "
                    f"the classes are {', '.join(sorted(table))}"
                )
        return self

    @field_validator("k8s_image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: str) -> str:
        parse_names(value)
        return value


@dataclass(frozen=True, slots=True)
class Toleration:
    """One toleration, as the pod's spec writes it: `key` None with Exists tolerates
    every taint; `effect` None, every effect."""

    key: str | None
    operator: Literal["Equal", "Exists"]
    value: str | None
    effect: str | None


def parse_tolerations(value: str) -> dict[str, list[Toleration]]:
    """`entry=nvidia.com/gpu:NoSchedule@sku=gpu:NoSchedule,…` as {class: tolerations}.
    ValueError naming the bad part."""
    found: dict[str, list[Toleration]] = {}
    example = "e.g. entry=nvidia.com/gpu:NoSchedule@sku=gpu:NoSchedule"
    for part in filter(None, (p.strip() for p in value.split(","))):
        cls, sep, rest = (x.strip() for x in part.partition("="))
        if not sep or cls not in _CLASSES or not rest:
            raise ValueError(
                f"{part[:80]!r} is not class=key[=value][:Effect] with a class of none, "
                f"entry, mid or high ({example})"
            )
        if cls in found:
            raise ValueError(f"{cls} is given twice")
        found[cls] = [_toleration(cls, one.strip()) for one in rest.split("@")]
    return found


def _toleration(cls: str, text: str) -> Toleration:
    taint, colon, effect = text.rpartition(":") if ":" in text else (text, "", "")
    if colon and effect not in _EFFECTS:
        raise ValueError(
            f"{text[:80]!r} in {cls}: the effect is one of {', '.join(_EFFECTS)} "
            "(or left out: every effect)"
        )
    if taint == "*":
        return Toleration(None, "Exists", None, effect or None)
    key, eq, label = taint.partition("=")
    if not _LABEL_KEY.fullmatch(key) or (eq and not _LABEL_VALUE.fullmatch(label)):
        raise ValueError(
            f"{text[:80]!r} in {cls} is not a taint key[=value][:Effect] "
            "(e.g. nvidia.com/gpu:NoSchedule, sku=gpu:NoSchedule)"
        )
    if eq:
        return Toleration(key, "Equal", label, effect or None)
    return Toleration(key, "Exists", None, effect or None)


def parse_priority_class_names(value: str) -> dict[str, str]:
    """`high=gpu-high,low=batch` as {lease class: PriorityClass}; ValueError naming the bad part."""
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        cls, sep, name = (x.strip() for x in part.partition("="))
        if not sep or not cls or not _SUBDOMAIN.fullmatch(name) or len(name) > 253:
            raise ValueError(
                f"{part[:80]!r} is not class=PriorityClass (a lowercase DNS name, "
                "e.g. high=openalice-high)"
            )
        if cls in found:
            raise ValueError(f"{cls} is given twice")
        found[cls] = name
    return found


def parse_names(value: str) -> list[str]:
    """A comma list of Secret names; ValueError naming a bad one."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    for name in names:
        if not _SUBDOMAIN.fullmatch(name) or len(name) > 253:
            raise ValueError(
                f"{name[:80]!r} is not a Secret name (lowercase letters, digits, '-' and '.')"
            )
    return names


def _zero(value: str) -> bool:
    digits = re.sub(r"[^0-9]", "", value)
    return not digits.strip("0")


def with_gpu_labels(classes: dict[str, GpuRequest], preset: str) -> dict[str, GpuRequest]:
    """Each class's request with the preset's node labels (K8S_GPU_LABELS), unless
    K8S_GPU_CLASSES gave the class labels of its own."""
    labels = GPU_LABEL_PRESETS[preset]
    return {
        cls: request
        if request.node_selector
        else replace(request, node_selector=dict(labels.get(cls, {})))
        for cls, request in classes.items()
    }
