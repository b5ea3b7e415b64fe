"""A pod's `status` as the kubelet writes it, step by step: bound, waiting (why), running,
ready, terminated, deadline exceeded."""

from __future__ import annotations

from typing import Any

from .store import Store, rfc3339

DEADLINE_MESSAGE = "Pod was active on the node longer than the specified deadline"


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


def _ended(pod: dict[str, Any], phase: str, now: str) -> None:
    pod["status"]["phase"] = phase
    reason = "PodCompleted" if phase == "Succeeded" else "PodFailed"
    set_condition(pod, "Ready", "False", reason, now=now)
    set_condition(pod, "ContainersReady", "False", reason, now=now)
    set_condition(pod, "PodReadyToStartContainers", "False", now=now)


def terminated(
    pod: dict[str, Any],
    code: int,
    container_id: str,
    started: str | None,
    finished: str | None,
    now: str,
) -> None:
    container = _container_status(pod)
    previous = container.get("state", {}).get("running", {})
    container["state"] = {
        "terminated": {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": previous.get("startedAt") or _trim(started) or now,
            "finishedAt": _trim(finished) or now,
            "containerID": f"docker://{container_id}",
        }
    }
    container["ready"] = False
    container["started"] = False
    _ended(pod, "Succeeded" if code == 0 else "Failed", now)


def deadline_exceeded(pod: dict[str, Any], now: str) -> None:
    container = _container_status(pod)
    state = container.get("state", {})
    if "running" in state:
        container["state"] = {
            "terminated": {
                "exitCode": 137,
                "reason": "Error",
                "startedAt": state["running"]["startedAt"],
                "finishedAt": now,
                "containerID": container.get("containerID"),
            }
        }
    container["ready"] = False
    container["started"] = False
    _ended(pod, "Failed", now)
    pod["status"]["reason"] = "DeadlineExceeded"
    pod["status"]["message"] = DEADLINE_MESSAGE


def _trim(docker_time: str | None) -> str | None:
    """Docker's `2026-12-02T10:00:00.123456789Z` as Kubernetes writes it (seconds)."""
    if not docker_time or docker_time.startswith("0001-"):
        return None
    return docker_time.split(".")[0].rstrip("Z") + "Z"
