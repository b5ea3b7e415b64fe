"""What a lease is made of on Kubernetes, and how its pod's status reads: the Pod and
the Secret the provider creates (lightkube's typed models), and the few facts of a pod's
status the provider acts on. No API is called here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lightkube.models.core_v1 import (
    Container,
    ContainerPort,
    EnvFromSource,
    PodSpec,
    ResourceRequirements,
    SecretEnvSource,
)
from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.resources.core_v1 import Pod, Secret

from openalice_scheduler.config.kubernetes import GpuRequest
from openalice_scheduler.models import LostCause
from openalice_scheduler.providers.base import WorkerDeath
from openalice_scheduler.providers.kubernetes import podspec
from openalice_scheduler.providers.kubernetes.podspec import PodFit

# The labels every pod and secret of this scheduler carries.
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "openalice-scheduler"
LABEL_INSTANCE = "openalice.io/instance"
LABEL_STORE = "openalice.io/store"
LABEL_LEASE = "openalice.io/lease"
LABEL_KIND = "openalice.io/kind"
LABEL_GPU = "openalice.io/gpu"
# The worker's container in its pod.
CONTAINER = "worker"
# Waiting reasons of a container that will not start without someone changing something:
# its image's name cannot be parsed, or it may not be pulled and is not on the node.
NEVER_STARTS = frozenset({"InvalidImageName", "ErrImageNeverPull"})
# Waiting reasons of a pull that failed and will be tried again (with the kubelet's
# backoff): often transient (a registry's rate limit, a slow network), given up after
# K8S_IMAGE_PULL_TIMEOUT_SECONDS (docs/backends/kubernetes.md#image-pulls).
PULL_FAILING = frozenset({"ErrImagePull", "ImagePullBackOff"})

# A CreateContainerConfigError is mostly passing (the worker's Secret is made just after
# its pod); the kubelet's refusal of an image's user under runAsNonRoot is not: it says
# so each time it tries (pkg/kubelet/kuberuntime/security_context_others.go).
NON_ROOT_REFUSALS = (
    "container has runAsNonRoot and image",
    "container's runAsUser breaks non-root policy",
)


@dataclass(frozen=True, slots=True)
class PodPlan:
    """Everything a lease's pod is made of, besides its worker's environment."""

    name: str
    namespace: str
    labels: dict[str, str]
    image: str
    port: int
    gpu: GpuRequest | None
    deadline_seconds: int
    grace_seconds: int
    # What the cluster asks of it: requests, tolerations, security, priority, pull secrets.
    fit: PodFit


def pod(plan: PodPlan) -> Pod:
    """The lease's Pod: one container, never restarted, ended by the kubelet at its
    deadline; its environment comes from the Secret of the same name (never the spec).
    It has no readiness probe of its own: the kubelet probes at most once a second, so
    its Ready condition says the container started, and the scheduler's own probe
    (RENDERER_READY_PATH, probe.py) says when the worker answers, as for every provider."""
    # Requests equal to limits: a Guaranteed pod, the last its node evicts under pressure
    # (https://kubernetes.io/docs/concepts/workloads/pods/pod-qos/#guaranteed). The GPU,
    # an extended resource, is asked by its limit alone (its request defaults to it).
    sized = {"cpu": plan.fit.cpu, "memory": plan.fit.memory}
    limits = dict(sized)
    if plan.gpu is not None:
        limits[plan.gpu.resource] = str(plan.gpu.count)
    resources = ResourceRequirements(requests=sized, limits=limits)
    return Pod(
        metadata=ObjectMeta(name=plan.name, namespace=plan.namespace, labels=plan.labels),
        spec=PodSpec(
            restartPolicy="Never",
            activeDeadlineSeconds=plan.deadline_seconds,
            terminationGracePeriodSeconds=plan.grace_seconds,
            # The worker has no business with the cluster's API, nor with its services.
            automountServiceAccountToken=False,
            enableServiceLinks=False,
            nodeSelector=(plan.gpu.node_selector or None) if plan.gpu else None,
            tolerations=podspec.tolerations(plan.fit),
            priorityClassName=plan.fit.priority_class_name,
            imagePullSecrets=podspec.pull_secrets(plan.fit),
            securityContext=podspec.pod_security(plan.fit),
            containers=[
                Container(
                    name=CONTAINER,
                    image=plan.image,
                    ports=[ContainerPort(containerPort=plan.port, name="http")],
                    envFrom=[EnvFromSource(secretRef=SecretEnvSource(name=plan.name))],
                    resources=resources,
                    securityContext=podspec.container_security(plan.fit),
                )
            ],
        ),
    )


def secret(plan: PodPlan, owner_uid: str, env: Mapping[str, str]) -> Secret:
    """The Secret holding the worker's environment, owned by its pod: Kubernetes' garbage
    collector removes it with the pod, whoever deletes the pod."""
    return Secret(
        metadata=ObjectMeta(
            name=plan.name,
            namespace=plan.namespace,
            labels=plan.labels,
            ownerReferences=[
                OwnerReference(apiVersion="v1", kind="Pod", name=plan.name, uid=owner_uid)
            ],
        ),
        type="Opaque",
        stringData=dict(env),
    )


@dataclass(frozen=True, slots=True)
class PodState:
    """What the provider acts on in a pod's status."""

    phase: str
    ip: str | None
    ready: bool
    ending: bool
    # The scheduler's words, while the pod is not placed for want of room.
    unschedulable: str | None
    # A container that will not start: its reason and message.
    never_starts: str | None
    # A container whose image pull failed and is tried again: its reason and message.
    pull_failing: str | None
    # Why the pod ended, when it has.
    ended: str | None


def state(obj: Pod) -> PodState:
    status = obj.status
    phase = (status.phase if status else None) or "Pending"
    conditions = {c.type: c for c in (status.conditions or [])} if status else {}
    ready = conditions.get("Ready")
    scheduled = conditions.get("PodScheduled")
    unschedulable = None
    if (
        scheduled is not None
        and scheduled.status == "False"
        and scheduled.reason == "Unschedulable"
    ):
        unschedulable = scheduled.message or "unschedulable"
    never_starts = None
    pull_failing = None
    ended = None
    for container in (status.containerStatuses or []) if status else []:
        waiting = container.state.waiting if container.state else None
        if waiting is not None and waiting.reason in NEVER_STARTS | PULL_FAILING:
            words = f"{waiting.reason}: {(waiting.message or '')[:200]}".rstrip(": ")
            if waiting.reason in NEVER_STARTS:
                never_starts = words
            else:
                pull_failing = words
        elif waiting is not None and (waiting.message or "").startswith(NON_ROOT_REFUSALS):
            never_starts = f"{waiting.reason}: {(waiting.message or '')[:200]} (K8S_RUN_AS_USER)"
        terminated = container.state.terminated if container.state else None
        if terminated is not None:
            ended = f"exit code {terminated.exitCode} ({terminated.reason or 'no reason'})"
    if phase in ("Failed", "Succeeded") and status is not None and status.reason:
        ended = f"{status.reason}: {status.message or ''}".rstrip(": ")
    return PodState(
        phase=phase,
        ip=status.podIP if status else None,
        ready=ready is not None and ready.status == "True",
        ending=obj.metadata is not None and obj.metadata.deletionTimestamp is not None,
        unschedulable=unschedulable,
        never_starts=never_starts,
        pull_failing=pull_failing,
        ended=ended if phase in ("Failed", "Succeeded") else None,
    )


# Why a pod is about to go, by its DisruptionTarget condition's reason (Kubernetes docs,
# Pod disruption conditions: https://kubernetes.io/docs/concepts/workloads/pods/disruptions/
# #pod-disruption-conditions): evicted by the kubelet, the Eviction API or the scheduler
# (for a pod of a higher priority); deleted because its node is unreachable (the taint
# manager) or gone (pod garbage collection).
_DISRUPTED = {
    "TerminationByKubelet": LostCause.evicted,
    "EvictionByEvictionAPI": LostCause.evicted,
    "PreemptionByScheduler": LostCause.evicted,
    "DeletionByTaintManager": LostCause.node_lost,
    "DeletionByPodGC": LostCause.node_lost,
}
# Why a pod failed, by its status' reason (Kubernetes docs: node-pressure eviction,
# https://kubernetes.io/docs/concepts/scheduling-eviction/node-pressure-eviction/;
# activeDeadlineSeconds, https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/
# ; NodeLost, the reason older node controllers gave a pod of a lost node).
_FAILED = {
    "Evicted": LostCause.evicted,
    "DeadlineExceeded": LostCause.deadline,
    "NodeLost": LostCause.node_lost,
}


def death(obj: Pod, *, deleted: bool = False) -> WorkerDeath | None:
    """How the pod's worker stopped for good
    (docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out), or None while it runs or
    starts. `deleted`: the pod itself is gone (a DELETED event): a worker deleted with no other word
    of why is `unknown`."""
    status = obj.status
    phase = (status.phase if status else None) or "Pending"
    conditions = {c.type: c for c in (status.conditions or [])} if status else {}
    disruption = conditions.get("DisruptionTarget")
    terminated = None
    for container in (status.containerStatuses or []) if status else []:
        if container.state is not None and container.state.terminated is not None:
            terminated = container.state.terminated
    code = terminated.exitCode if terminated is not None else None
    reason = (status.reason if status else None) or ""
    message = f"{reason}: {(status.message if status else None) or ''}".strip(": ")
    if disruption is not None and disruption.status == "True" and disruption.reason in _DISRUPTED:
        words = f"{disruption.reason}: {disruption.message or ''}".strip(": ")
        return WorkerDeath(_DISRUPTED[disruption.reason], code, words[:300])
    if phase in ("Failed", "Succeeded") and reason in _FAILED:
        return WorkerDeath(_FAILED[reason], code, message[:300])
    if terminated is not None:
        cause = LostCause.oom_killed if terminated.reason == "OOMKilled" else LostCause.exited
        words = f"exit code {code} ({terminated.reason or 'no reason'})"
        return WorkerDeath(cause, code, words)
    if phase in ("Failed", "Succeeded"):
        return WorkerDeath(LostCause.unknown, None, message or f"pod {phase}")
    if deleted:
        return WorkerDeath(LostCause.unknown, None, "the pod was deleted")
    return None
