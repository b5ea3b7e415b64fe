"""Kubernetes' settings (docs/backends/kubernetes.md#workers-on-kubernetes)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

# What K8S_GPU_CLASSES is when unset: one NVIDIA GPU per class, on the nodes that
# K8S_GPU_LABELS' preset labels for it (kubernetes_pods.py).
K8S_DEFAULT_GPU_CLASSES = "entry=nvidia.com/gpu:1,mid=nvidia.com/gpu:1,high=nvidia.com/gpu:1"
# A DNS-1123 label (a namespace's name), and a label's key and value (Kubernetes' own).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


class KubernetesSettings(BaseSettings):
    """Pods on a Kubernetes cluster: the context and namespace, each kind's image, the
    GPU classes' resources and node selectors, the cap, prices, the pod's deadline and
    grace, and its readiness."""

    k8s_context: str | None = Field(
        None, description="The kubeconfig context to use (KUBECONFIG's current one if unset)."
    )
    k8s_namespace: str = Field("openalice", description="Where the pods and secrets are made.")
    k8s_renderer_image: str = Field(
        "openalice-demo-worker:latest",
        min_length=1,
        description="The renderer worker's image; the image's own entrypoint runs.",
    )
    k8s_anim_image: str = Field(
        "openalice-demo-worker:latest",
        min_length=1,
        description="The anim worker's image, as K8S_RENDERER_IMAGE.",
    )
    k8s_gpu_classes: str = Field(
        K8S_DEFAULT_GPU_CLASSES,
        description="Per GPU class, the pod's resource and node selector: "
        "class=resource:count[@label=value...], comma separated; a class without labels "
        "gets K8S_GPU_LABELS' preset.",
    )
    k8s_max_pods: int = Field(0, ge=0, description="Cap on live pods; 0 = none.")
    k8s_price_per_hour: str = Field("0", description="USD per hour, one price or per class.")
    k8s_schedule_timeout_seconds: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="How long a pod may stay unschedulable before the next provider is tried.",
    )
    k8s_scale_up_timeout_seconds: float = Field(
        600.0,
        gt=0,
        le=3600,
        description="How long an unschedulable pod that triggered the cluster autoscaler's "
        "scale-up (its TriggeredScaleUp event) is waited for, instead of "
        "K8S_SCHEDULE_TIMEOUT_SECONDS; PROVISION_TIMEOUT_SECONDS still bounds the whole start.",
    )
    k8s_image_pull_timeout_seconds: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="How long a pod's image pull may keep failing (ErrImagePull, "
        "ImagePullBackOff: often transient) before the acquire gives it up; InvalidImageName "
        "and ErrImageNeverPull are given up at once.",
    )
    k8s_pod_deadline_seconds: int = Field(
        86_400,
        ge=60,
        description="The pod's activeDeadlineSeconds, enforced by the kubelet: the longest "
        "a lease on Kubernetes lives, renewals included.",
    )
    k8s_termination_grace_seconds: int = Field(
        30,
        ge=0,
        le=3600,
        description="The pod's terminationGracePeriodSeconds: SIGTERM, then SIGKILL after it.",
    )
    k8s_ready_timeout_seconds: float = Field(
        300.0,
        ge=0,
        description="How long a new pod, once Running and Ready, has to pass the "
        "scheduler's own readiness probe (a pod without a probe of its own is Ready as "
        "soon as its container runs, listening or not); 0 = not probed.",
    )
    k8s_region: str | None = Field(
        None, max_length=64, description="The region this cluster serves, for `region`."
    )

    @field_validator("k8s_namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not _DNS_LABEL.fullmatch(value):
            raise ValueError(
                f"{value[:64]!r} is not a namespace name (lowercase letters, digits and "
                "'-', at most 63)"
            )
        return value

    @field_validator("k8s_gpu_classes")
    @classmethod
    def _gpu_classes(cls, value: str) -> str:
        parse_gpu_classes(value)
        return value


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """What a GPU class asks of Kubernetes: `count` of the extended `resource` (as the
    container's limit), on a node with every label of `node_selector`."""

    resource: str
    count: int
    node_selector: dict[str, str]


def parse_gpu_classes(value: str) -> dict[str, GpuRequest]:
    """`entry=nvidia.com/gpu:1@nvidia.com/gpu.product=NVIDIA-L4,…` as {class: request}.
    ValueError naming the bad part."""
    found: dict[str, GpuRequest] = {}
    example = "e.g. entry=nvidia.com/gpu:1@nvidia.com/gpu.product=NVIDIA-L4"
    for part in filter(None, (p.strip() for p in value.split(","))):
        cls, sep, rest = (x.strip() for x in part.partition("="))
        if not sep or cls not in ("entry", "mid", "high"):
            raise ValueError(
                f"{part[:80]!r} is not class=resource:count with a class of entry, mid or "
                f"high ({example})"
            )
        if cls in found:
            raise ValueError(f"{cls} is given twice")
        resource_part, *selectors = rest.split("@")
        resource, colon, count = resource_part.strip().rpartition(":")
        if not colon or not _LABEL_KEY.fullmatch(resource) or not count.isdigit():
            raise ValueError(f"{rest[:80]!r} does not start with resource:count ({example})")
        if int(count) < 1:
            raise ValueError(f"{cls}: a GPU class asks for at least 1 of {resource}")
        node_selector: dict[str, str] = {}
        for selector in selectors:
            key, eq, label = (x.strip() for x in selector.partition("="))
            if not eq or not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(label):
                raise ValueError(
                    f"{selector[:80]!r} in {cls} is not a node label=value "
                    "(e.g. @nvidia.com/gpu.product=NVIDIA-L4)"
                )
            node_selector[key] = label
        found[cls] = GpuRequest(resource, int(count), node_selector)
    return found
