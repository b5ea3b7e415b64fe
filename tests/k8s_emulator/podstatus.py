"""A pod's `status` as the kubelet (and the PodGC controller) write it, step by step:
bound, waiting (why), running, ready, terminated (exited, OOM-killed, stopped for a
delete), deadline exceeded, evicted, collected with its lost node."""

from __future__ import annotations

from typing import Any

from .runtime import Exit
from .store import Store, rfc3339

DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"
EVICTED_REASON = "Evicted"  # kubernetes/kubernetes pkg/kubelet/eviction/helpers.go Reason
PODGC_MESSAGE = "PodGC: node no longer exists"  # pkg/controller/podgc/gc_controller.go


def rfc3339_in(store: Store, seconds: float) -> str:
    return rfc3339(store.now() + seconds)


def set_condition(
    pod: dict[str, Any],
    kind: str,
    status: str,
    reason: str | None = None,
    message: str | None = None,
    now: str | None = None,
) -> None:
    conditions = pod["status"].setdefault("conditions", [])
    current = next((c for c in conditions if c["type"] == kind), None)
    if current is not None and (
        current["status"],
        current.get("reason"),
        current.get("message"),
    ) == (
        status,
        reason,
        message,
    ):
        return
    condition: dict[str, Any] = {
        "type": kind,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": now,
    }
    if current is not None and current["status"] == status:
        condition["lastTransitionTime"] = current.get("lastTransitionTime")
    if reason:
        condition["reason"] = reason
    if message:
        condition["message"] = message
    if current is None:
        conditions.append(condition)
    else:
        conditions[conditions.index(current)] = condition


def _container_status(pod: dict[str, Any]) -> dict[str, Any]:
    container = pod["spec"]["containers"][0]
    statuses = pod["status"].setdefault("containerStatuses", [])
    if not statuses:
        statuses.append(
            {
                "name": container["name"],
                "state": {"waiting": {"reason": "ContainerCreating"}},
                "lastState": {},
                "ready": False,
                "restartCount": 0,
                "image": container["image"],
                "imageID": "",
                "started": False,
            }
        )
    return statuses[0]  # type: ignore[no-any-return]


def bound(pod: dict[str, Any], host_ip: str, now: str) -> None:
    """Bound to a node and admitted by its kubelet: startTime, conditions, waiting."""
    status = pod["status"]
    set_condition(pod, "PodScheduled", "True", now=now)
    set_condition(pod, "PodReadyToStartContainers", "False", now=now)
    set_condition(pod, "Initialized", "True", now=now)
    set_condition(pod, "Ready", "False", "ContainersNotReady", _not_ready(pod), now)
    set_condition(pod, "ContainersReady", "False", "ContainersNotReady", _not_ready(pod), now)
    status["hostIP"] = host_ip
    status["hostIPs"] = [{"ip": host_ip}]
    status["startTime"] = now
    _container_status(pod)


def _not_ready(pod: dict[str, Any]) -> str:
    return f"containers with unready status: [{pod['spec']['containers'][0]['name']}]"


def waiting(pod: dict[str, Any], reason: str, message: str) -> None:
    _container_status(pod)["state"] = {"waiting": {"reason": reason, "message": message}}


def image_pull_failed(pod: dict[str, Any], image: str, *, backoff: bool) -> None:
    if backoff:
        waiting(pod, "ImagePullBackOff", f'Back-off pulling image "{image}"')
    else:
        waiting(
            pod,
            "ErrImagePull",
            f'Failed to pull image "{image}": rpc error: code = NotFound desc = failed to '
            f'pull and unpack image "{image}": failed to resolve reference "{image}": '
            f"{image}: not found",
        )


def running(
    pod: dict[str, Any],
    container_id: str,
    image_id: str,
    address: str,
    now: str,
    *,
    ready: bool,
) -> None:
    status = pod["status"]
    status["phase"] = "Running"
    status["podIP"] = address
    status["podIPs"] = [{"ip": address}]
    container = _container_status(pod)
    container.update(
        {
            "state": {"running": {"startedAt": now}},
            "ready": ready,
            "started": True,
            "imageID": image_id,
            "containerID": f"docker://{container_id}",
        }
    )
    set_condition(pod, "PodReadyToStartContainers", "True", now=now)
    if ready:
        set_condition(pod, "Ready", "True", now=now)
        set_condition(pod, "ContainersReady", "True", now=now)


def ready(pod: dict[str, Any], now: str) -> None:
    _container_status(pod)["ready"] = True
    set_condition(pod, "Ready", "True", now=now)
    set_condition(pod, "ContainersReady", "True", now=now)


def ended(pod: dict[str, Any], phase: str, now: str) -> None:
    """The pod's terminal phase, written once its containers are stopped: the kubelet
    never reports a terminal phase while a container could still run, and then turns
    Ready and ContainersReady False (`PodCompleted`/`PodFailed`) and its sandbox is gone
    (kubernetes/kubernetes pkg/kubelet/status/status_manager.go, mergePodStatus;
    https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-phase)."""
    pod["status"]["phase"] = phase
    reason = "PodCompleted" if phase == "Succeeded" else "PodFailed"
    set_condition(pod, "Ready", "False", reason, now=now)
    set_condition(pod, "ContainersReady", "False", reason, now=now)
    set_condition(pod, "PodReadyToStartContainers", "False", now=now)


def terminated(pod: dict[str, Any], end: Exit, container_id: str, now: str) -> None:
    """The container's `state.terminated` as the runtime reports it: its exit code, and
    reason `OOMKilled` when the kernel's OOM killer ended it, else `Completed` (0) or
    `Error` (https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#container-state-terminated,
    https://kubernetes.io/docs/tasks/configure-pod-container/assign-memory-resource/#exceed-a-container-s-memory-limit)."""
    container = _container_status(pod)
    previous = container.get("state", {}).get("running", {})
    reason = "OOMKilled" if end.oom_killed else "Completed" if end.code == 0 else "Error"
    container["state"] = {
        "terminated": {
            "exitCode": end.code,
            "reason": reason,
            "startedAt": previous.get("startedAt") or _trim(end.started) or now,
            "finishedAt": _trim(end.finished) or now,
            "containerID": f"docker://{container_id}",
        }
    }
    container["ready"] = False
    container["started"] = False


def _container_stopped(
    pod: dict[str, Any], end: Exit | None, container_id: str | None, now: str
) -> None:
    """The container the kubelet stopped: terminated as the runtime reports its end, or,
    with no end to report (it never ran, or is gone), no longer ready nor started."""
    if end is not None and container_id is not None:
        terminated(pod, end, container_id, now)
    else:
        container = _container_status(pod)
        container["ready"] = False
        container["started"] = False


def exited(pod: dict[str, Any], end: Exit, container_id: str, now: str) -> None:
    """The container ended by itself (or by the OOM killer) and is not restarted: the
    pod is Succeeded if it exited 0, else Failed
    (https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-phase)."""
    terminated(pod, end, container_id, now)
    ended(pod, "Succeeded" if end.code == 0 else "Failed", now)


def stopped(pod: dict[str, Any], end: Exit | None, container_id: str | None, now: str) -> None:
    """The kubelet stopped the container of a pod being deleted: the pod is written
    Succeeded if it exited 0, else Failed, before the Pod object goes ("the kubelet
    transitions deleted Pods ... to a terminal phase (Failed or Succeeded depending on the
    exit statuses of the pod containers) before their deletion from the API server",
    https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-phase)."""
    if end is not None and container_id is not None:
        terminated(pod, end, container_id, now)
    ended(pod, "Succeeded" if end is not None and end.code == 0 else "Failed", now)


def deadline_passed(pod: dict[str, Any], now: str) -> None:
    """The kubelet has found the deadline passed and starts stopping the container: its
    status is computed with phase Failed, so Ready and ContainersReady turn False
    (`PodFailed`) at once, while the phase itself waits until the container has stopped
    (kubernetes/kubernetes pkg/kubelet/kubelet_pods.go generateAPIPodStatus and
    pkg/kubelet/status/status_manager.go mergePodStatus)."""
    set_condition(pod, "Ready", "False", "PodFailed", now=now)
    set_condition(pod, "ContainersReady", "False", "PodFailed", now=now)


def deadline_exceeded(
    pod: dict[str, Any], end: Exit | None, container_id: str | None, now: str
) -> None:
    """Failed, reason DeadlineExceeded, whatever the container's exit code
    (`activeDeadlineSeconds`, https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/pod-v1/#lifecycle:
    "... before the system will actively try to mark it failed and kill associated
    containers"; kubernetes/kubernetes pkg/kubelet/active_deadline.go)."""
    _container_stopped(pod, end, container_id, now)
    ended(pod, "Failed", now)
    pod["status"]["reason"] = "DeadlineExceeded"
    pod["status"]["message"] = DEADLINE_MESSAGE


def evicted(
    pod: dict[str, Any], end: Exit | None, container_id: str | None, message: str, now: str
) -> None:
    """Evicted by the kubelet for node pressure, its container stopped: phase Failed,
    reason Evicted, the eviction message, and condition DisruptionTarget True (reason
    TerminationByKubelet, the same message)
    (https://kubernetes.io/docs/concepts/scheduling-eviction/node-pressure-eviction/,
    https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions).
    A container that exits 0 at the SIGTERM makes the pod Succeeded instead, without the
    reason and message (the DisruptionTarget condition stays): the kubelet computes the
    terminal phase from the exit codes since 1.27 (kubernetes/kubernetes issues 118310,
    120182, 141483)."""
    _container_stopped(pod, end, container_id, now)
    set_condition(pod, "DisruptionTarget", "True", "TerminationByKubelet", message, now)
    if end is not None and end.code == 0:
        ended(pod, "Succeeded", now)
        return
    ended(pod, "Failed", now)
    pod["status"]["reason"] = EVICTED_REASON
    pod["status"]["message"] = message


def collected(pod: dict[str, Any], now: str) -> None:
    """What the PodGC controller patches into a pod bound to a node that no longer
    exists, before it deletes it (grace 0): phase Failed (unless already terminal) and
    condition DisruptionTarget True, reason DeletionByPodGC; nothing else changes (no
    kubelet is left to report)
    (https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/#pod-garbage-collection,
    https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions;
    kubernetes/kubernetes pkg/controller/podgc/gc_controller.go gcOrphaned)."""
    pod["status"]["phase"] = "Failed"
    set_condition(pod, "DisruptionTarget", "True", "DeletionByPodGC", PODGC_MESSAGE, now)


def _trim(docker_time: str | None) -> str | None:
    """Docker's `2026-12-02T10:00:00.123456789Z` as Kubernetes writes it (seconds)."""
    if not docker_time or docker_time.startswith("0001-"):
        return None
    return docker_time.split(".")[0].rstrip("Z") + "Z"
