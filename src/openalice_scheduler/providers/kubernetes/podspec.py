"""The parts of a lease's pod that the clusters people run ask for
(docs/backends/kubernetes.md#the-pod-a-cluster-accepts): CPU and memory requests equal to
their limits (Guaranteed QoS), the tolerations of the GPU nodes' taints, the security
context of a Pod Security level, a PriorityClass, the image pull secrets. No API is
called here."""

from __future__ import annotations

from dataclasses import dataclass

from lightkube.models.core_v1 import (
    Capabilities,
    LocalObjectReference,
    PodSecurityContext,
    SeccompProfile,
    SecurityContext,
    Toleration,
)

from openalice_scheduler.config import Settings
from openalice_scheduler.config import kubernetes_pods as cfg


@dataclass(frozen=True, slots=True)
class PodShape:
    """What a pod asks of the cluster besides its image and GPU: per kind its CPU and
    memory (requests = limits), per class its tolerations and PriorityClass, and the
    cluster's Pod Security level, run-as user and image pull secrets."""

    cpu: dict[str, str]
    memory: dict[str, str]
    tolerations: dict[str, list[cfg.Toleration]]
    security: str
    # Under restricted: the user id the container runs as; None: the image's own.
    run_as_user: int | None
    priority_classes: dict[str, str]
    pull_secrets: tuple[str, ...]

    @classmethod
    def from_settings(cls, settings: Settings) -> PodShape:
        user = settings.k8s_run_as_user
        return cls(
            cpu={"renderer": settings.k8s_renderer_cpu, "anim": settings.k8s_anim_cpu},
            memory={"renderer": settings.k8s_renderer_memory, "anim": settings.k8s_anim_memory},
            tolerations=cfg.parse_tolerations(settings.k8s_tolerations),
            security=settings.k8s_pod_security,
            run_as_user=None if user == "image" else int(user),
            priority_classes=cfg.parse_priority_class_names(settings.k8s_priority_class_names),
            pull_secrets=tuple(cfg.parse_names(settings.k8s_image_pull_secrets)),
        )


@dataclass(frozen=True, slots=True)
class PodFit:
    """One pod's share of a PodShape: what objects.pod writes into its spec."""

    cpu: str
    memory: str
    tolerations: tuple[cfg.Toleration, ...]
    security: str
    run_as_user: int | None
    priority_class_name: str | None
    pull_secrets: tuple[str, ...]


def fit(shape: PodShape, kind: str, gpu: str, priority_class: str | None) -> PodFit:
    return PodFit(
        cpu=shape.cpu[kind],
        memory=shape.memory[kind],
        tolerations=tuple(shape.tolerations.get(gpu, ())),
        security=shape.security,
        run_as_user=shape.run_as_user,
        priority_class_name=shape.priority_classes.get(priority_class or ""),
        pull_secrets=shape.pull_secrets,
    )


def tolerations(fit: PodFit) -> list[Toleration] | None:
    return [
        Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect)
        for t in fit.tolerations
    ] or None


def pull_secrets(fit: PodFit) -> list[LocalObjectReference] | None:
    return [LocalObjectReference(name=name) for name in fit.pull_secrets] or None


def pod_security(fit: PodFit) -> PodSecurityContext:
    """The pod's security context. Both levels ask for the runtime's default seccomp
    profile; restricted also for a non-root user (a numeric one: the kubelet refuses to
    start an image whose user is root, or a name it cannot check, under runAsNonRoot)
    (https://kubernetes.io/docs/concepts/security/pod-security-standards/#restricted)."""
    seccomp = SeccompProfile(type="RuntimeDefault")
    if fit.security != "restricted":
        return PodSecurityContext(seccompProfile=seccomp)
    return PodSecurityContext(runAsNonRoot=True, runAsUser=fit.run_as_user, seccompProfile=seccomp)


def container_security(fit: PodFit) -> SecurityContext | None:
    """The container's: under restricted, no privilege escalation and every capability
    dropped (the level allows adding NET_BIND_SERVICE back; the worker does not need it)."""
    if fit.security != "restricted":
        return None
    return SecurityContext(allowPrivilegeEscalation=False, capabilities=Capabilities(drop=["ALL"]))
