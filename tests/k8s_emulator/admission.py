"""Admission of a new pod, as the API server's built-in plugins do it: Priority (a named
PriorityClass must exist; the pod gets its value) and PodSecurity (a namespace labelled
`pod-security.kubernetes.io/enforce` refuses a pod that breaks its level), and the
kubelet's own check of `runAsNonRoot` against the user a container would run as.

- Priority: https://kubernetes.io/docs/concepts/scheduling-eviction/pod-priority-preemption/
  (plugin/pkg/admission/priority: 403 `pods "x" is forbidden: no PriorityClass with name
  y was found`; the two system classes always exist; without a class the pod's priority
  is 0, there being no globalDefault class here).
- PodSecurity: https://kubernetes.io/docs/concepts/security/pod-security-admission/ and
  https://kubernetes.io/docs/concepts/security/pod-security-standards/ (the checks of
  k8s.io/pod-security-admission/policy, their reasons and details word for word; 403
  `pods "x" is forbidden: violates PodSecurity "restricted:latest": reason (detail), ...`).
- runAsNonRoot: pkg/kubelet/kuberuntime/security_context_others.go (`verifyRunAsNonRoot`),
  a CreateContainerConfigError.
"""

from __future__ import annotations

from typing import Any

from .kstatus import ApiError

ENFORCE = "pod-security.kubernetes.io/enforce"
ENFORCE_VERSION = "pod-security.kubernetes.io/enforce-version"
LEVELS = ("privileged", "baseline", "restricted")
SYSTEM_PRIORITY_CLASSES = {
    "system-cluster-critical": 2000000000,
    "system-node-critical": 2000001000,
}
# The capabilities baseline lets a container add (the policy's
# capabilities_baseline check); restricted lets it add NET_BIND_SERVICE only.
_BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}


def forbidden(name: str, message: str) -> ApiError:
    return ApiError(
        403,
        f'pods "{name}" is forbidden: {message}',
        reason="Forbidden",
        details={"name": name, "kind": "pods"},
    )


def admit_priority(pod: dict[str, Any], classes: dict[str, int]) -> None:
    """The Priority plugin: the class must exist; spec.priority becomes its value."""
    spec = pod.get("spec") or {}
    name = spec.get("priorityClassName")
    if not name:
        spec.setdefault("priority", 0)
        return
    known = {**SYSTEM_PRIORITY_CLASSES, **classes}
    if name not in known:
        raise forbidden(
            (pod.get("metadata") or {}).get("name") or "",
            f"no PriorityClass with name {name} was found",
        )
    if spec.get("priority") is not None and spec["priority"] != known[name]:
        raise forbidden(
            (pod.get("metadata") or {}).get("name") or "",
            "the integer value of priority "
            f"({spec['priority']}) must not be provided in pod spec; priority admission "
            f"controller computed {known[name]} from the given PriorityClass name",
        )
    spec["priority"] = known[name]
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")


def admit_pod_security(pod: dict[str, Any], labels: dict[str, str]) -> None:
    """The PodSecurity plugin in enforce mode, at the namespace's level."""
    level = labels.get(ENFORCE, "privileged")
    if level not in LEVELS or level == "privileged":
        return
    version = labels.get(ENFORCE_VERSION, "latest")
    failures = _baseline(pod)
    if level == "restricted":
        failures += _restricted(pod)
    if failures:
        detail = ", ".join(f"{reason} ({why})" for reason, why in failures)
        raise forbidden(
            pod["metadata"]["name"], f'violates PodSecurity "{level}:{version}": {detail}'
        )


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod["spec"]
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _names(containers: list[dict[str, Any]]) -> str:
    quoted = ", ".join(f'"{c.get("name")}"' for c in containers)
    return f"container {quoted}" if len(containers) == 1 else f"containers {quoted}"


def _baseline(pod: dict[str, Any]) -> list[tuple[str, str]]:
    spec, failures = pod["spec"], []
    namespaces = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k)]
    if namespaces:
        failures.append(("host namespaces", ", ".join(namespaces)))
    privileged = [c for c in _containers(pod) if (c.get("securityContext") or {}).get("privileged")]
    if privileged:
        failures.append(
            ("privileged", f"{_names(privileged)} must not set securityContext.privileged=true")
        )
    added = []
    for container in _containers(pod):
        caps = ((container.get("securityContext") or {}).get("capabilities") or {}).get("add")
        added += [c for c in caps or [] if c not in _BASELINE_CAPABILITIES]
    if added:
        failures.append(("non-default capabilities", f"capabilities.add={added}"))
    return failures


def _restricted(pod: dict[str, Any]) -> list[tuple[str, str]]:
    spec, failures = pod["spec"], []
    pod_context = spec.get("securityContext") or {}
    containers = _containers(pod)

    def context(container: dict[str, Any]) -> dict[str, Any]:
        return container.get("securityContext") or {}

    escalating = [c for c in containers if context(c).get("allowPrivilegeEscalation") is not False]
    if escalating:
        failures.append(
            (
                "allowPrivilegeEscalation != false",
                f"{_names(escalating)} must set securityContext.allowPrivilegeEscalation=false",
            )
        )
    undropped = [
        c
        for c in containers
        if "ALL" not in ((context(c).get("capabilities") or {}).get("drop") or [])
    ]
    adding = [
        c
        for c in containers
        if set((context(c).get("capabilities") or {}).get("add") or []) - {"NET_BIND_SERVICE"}
    ]
    if undropped or adding:
        parts = []
        if undropped:
            parts.append(f'{_names(undropped)} must set securityContext.capabilities.drop=["ALL"]')
        if adding:
            parts.append(
                f"{_names(adding)} must not include "
                + ", ".join(
                    f'"{cap}"'
                    for c in adding
                    for cap in (context(c).get("capabilities") or {}).get("add") or []
                    if cap != "NET_BIND_SERVICE"
                )
                + " in securityContext.capabilities.add"
            )
        failures.append(("unrestricted capabilities", "; ".join(parts)))
    failures += _non_root(pod_context, containers, context)
    pod_seccomp = (pod_context.get("seccompProfile") or {}).get("type")
    unconfined = [
        c
        for c in containers
        if (context(c).get("seccompProfile") or {}).get("type", pod_seccomp)
        not in ("RuntimeDefault", "Localhost")
    ]
    if unconfined:
        who = "pod or " + _names(unconfined) if pod_seccomp is None else _names(unconfined)
        failures.append(
            (
                "seccompProfile",
                f'{who} must set securityContext.seccompProfile.type to "RuntimeDefault" '
                'or "Localhost"',
            )
        )
    return failures


def _non_root(pod_context: dict[str, Any], containers: list[Any], context: Any) -> list[Any]:
    failures = []
    if pod_context.get("runAsNonRoot") is False:
        failures.append(
            ("runAsNonRoot != true", "pod must not set securityContext.runAsNonRoot=false")
        )
    else:
        unset = [
            c
            for c in containers
            if context(c).get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True
        ]
        if unset:
            who = "pod or " + _names(unset)
            failures.append(
                ("runAsNonRoot != true", f"{who} must set securityContext.runAsNonRoot=true")
            )
    root = [c for c in containers if context(c).get("runAsUser") == 0]
    if pod_context.get("runAsUser") == 0 or root:
        who = "pod" if pod_context.get("runAsUser") == 0 else _names(root)
        failures.append(("runAsUser=0", f"{who} must not set runAsUser=0"))
    return failures


def run_as_non_root(pod: dict[str, Any], image_user: str) -> str | None:
    """The kubelet's refusal to start the pod's first container under runAsNonRoot, or
    None: the user is runAsUser (container, then pod), else the image's own."""
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    pod_context = spec.get("securityContext") or {}
    own = container.get("securityContext") or {}
    if not own.get("runAsNonRoot", pod_context.get("runAsNonRoot")):
        return None
    meta = pod["metadata"]
    where = f'(pod: "{meta["name"]}_{meta["namespace"]}({meta["uid"]})", container: {container["name"]})'  # noqa: E501 - the kubelet's own wording
    user = own.get("runAsUser", pod_context.get("runAsUser"))
    if user is not None:
        return f"container's runAsUser breaks non-root policy {where}" if user == 0 else None
    name = image_user.split(":")[0]
    if name in ("", "0"):
        return f"container has runAsNonRoot and image will run as root {where}"
    if not name.isdigit():
        return (
            f"container has runAsNonRoot and image has non-numeric user ({name}), cannot "
            f"verify user is non-root {where}"
        )
    return None
