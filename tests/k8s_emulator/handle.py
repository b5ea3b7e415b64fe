"""`KubeEmulator`: the emulator as a subprocess, and the test's handle on it.

    with KubeEmulator(network="oa-k8s-test") as kube:
        client = lightkube.Client(lightkube.KubeConfig.from_file(kube.kubeconfig_path))
        ...                                   # drive lightkube / the scheduler
        assert kube.pod("lease-1")["status"]["phase"] == "Running"

It starts `python -m tests.k8s_emulator` on free ports, waits until it answers, writes a
kubeconfig (contexts `emulator`, namespace openalice, and `other`, namespace default),
and on exit stops it and removes every container (and the network) of its instance by
label, also when the process died without doing so.
"""

from __future__ import annotations

import base64
import json
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tests.emulator_process import EmulatorProcess

from .runtime import LABEL_INSTANCE

_SLOW_CALL_SECONDS = 300.0


class KubeEmulator(EmulatorProcess):
    """`server_url`: `https://127.0.0.1:<port>`, the cluster's API server."""

    title = "the Kubernetes emulator"
    module = "tests.k8s_emulator"
    instance_label = LABEL_INSTANCE
    stop_timeout = 30.0

    def __init__(
        self,
        *,
        network: str | None = None,
        log_path: Path | None = None,
        token: str | None = None,
        namespaces: tuple[str, ...] = (),
        nodes: list[dict[str, Any]] | None = None,
        rbac: list[dict[str, Any]] | None = None,
        log_level: str = "INFO",
        extra_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(
            "k" + secrets.token_hex(5), log_path, network=network, extra_args=extra_args
        )
        self.token = token or "kt-" + secrets.token_urlsafe(24)
        self.namespaces = namespaces
        self.nodes = nodes
        self.rbac = rbac
        self.log_level = log_level
        self._dir = Path(tempfile.mkdtemp(prefix="k8s-emulator-handle-"))

    # --- process -----------------------------------------------------------------------

    @property
    def host_ip(self) -> str:
        """The node's address (the host's on the pods' network)."""
        return str(self.info["host_ip"])

    @property
    def kubeconfig_path(self) -> Path:
        return self._dir / "kubeconfig"

    def kubeconfig(self, namespace: str = "openalice", token: str | None = None) -> dict[str, Any]:
        """The kubeconfig as a user's would be: cluster `emulator` (server, CA data),
        user `emulator` (token), contexts `emulator` (namespace `namespace`, current) and
        `other` (namespace default)."""
        ca = base64.b64encode(Path(self.ca_file).read_bytes()).decode()
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "emulator",
                    "cluster": {"server": self.server_url, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": "emulator", "user": {"token": token or self.token}}],
            "contexts": [
                {
                    "name": "emulator",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
                },
                {
                    "name": "other",
                    "context": {"cluster": "emulator", "user": "emulator", "namespace": "default"},
                },
            ],
            "current-context": "emulator",
            "preferences": {},
        }

    def write_kubeconfig(self, path: Path, **kwargs: Any) -> Path:
        """Write a kubeconfig (YAML is a superset of JSON: written as JSON) to `path`."""
        path.write_text(json.dumps(self.kubeconfig(**kwargs), indent=2))
        path.chmod(0o600)
        return path

    def own_arguments(self) -> list[str]:
        return [
            "--state-dir",
            str(self._dir / "state"),
            "--log-level",
            self.log_level,
            *[arg for ns in self.namespaces for arg in ("--namespace", ns)],
            *(["--nodes", json.dumps(self.nodes)] if self.nodes is not None else []),
            *(["--rbac", json.dumps(self.rbac)] if self.rbac is not None else []),
        ]

    def environment(self) -> dict[str, str]:
        return {"K8S_EMULATOR_TOKEN": self.token}

    def started(self) -> None:
        self.write_kubeconfig(self.kubeconfig_path)

    def stopped(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    # --- control -----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Nodes, switches, clock offset, namespaces."""
        return dict(self._get("/_emulator/state"))

    def reset(self) -> None:
        """Delete every object and container; clear switches, audit, clock offset, RBAC,
        nodes (back to the default node)."""
        self._post("/_emulator/reset", {})

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """Full Pod objects (also those being deleted), by namespace and name."""
        return list(self._get("/_emulator/objects/pods", namespace=namespace))

    def pod(self, name: str, namespace: str = "openalice") -> dict[str, Any] | None:
        return next((p for p in self.pods(namespace) if p["metadata"]["name"] == name), None)

    def secrets(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return list(self._get("/_emulator/objects/secrets", namespace=namespace))

    def requests(self) -> list[dict[str, Any]]:
        """The audit list, oldest first: verb, resource, namespace, name, code, path,
        grace_period (pod deletes), label_selector (lists)."""
        return list(self._get("/_emulator/requests"))

    def containers(self) -> list[dict[str, Any]]:
        """Docker containers of this emulator: id, name, pod, namespace, uid, image, state."""
        return list(self._get("/_emulator/containers"))

    def advance_clock(self, seconds: float) -> list[str]:
        """Move the emulator's clock; answers once the kubelet acted on it, with the
        `namespace/name` of the pods that it ended by their deadline: each is then Failed
        (DeadlineExceeded) and its container stopped (after its grace period, at most) and
        removed."""
        return list(self._slow_post("/_emulator/clock", {"advance": seconds})["ended"])

    def oom_kill(self, name: str, namespace: str = "openalice") -> dict[str, Any]:
        """The kernel's OOM killer ends the pod's container (a real SIGKILL); answers
        with the Pod once it shows `terminated.reason: OOMKilled`, exit code 137, phase
        Failed. ValueError if the pod is not running on a node."""
        return dict(self._slow_post(f"/_emulator/pods/{namespace}/{name}/oom-kill", {}))

    def evict(
        self, name: str, namespace: str = "openalice", resource: str = "memory"
    ) -> dict[str, Any]:
        """The kubelet evicts the pod for node pressure on `resource` (memory only): its
        container is stopped (SIGTERM, SIGKILL after 2 s); answers with the Pod once it is
        Failed, reason Evicted, with DisruptionTarget True (TerminationByKubelet) -- or
        Succeeded, without the reason, if its container exited 0 at the SIGTERM, as the
        kubelet reports it. ValueError if the pod is not running on a node."""
        path = f"/_emulator/pods/{namespace}/{name}/evict"
        return dict(self._slow_post(path, {"resource": resource}))

    def lose_node(self, node_name: str) -> list[str]:
        """The node vanishes (its machine, then its Node object): its containers are
        removed, nothing reports for its pods, and the PodGC controller marks each of them
        Failed with DisruptionTarget True (DeletionByPodGC) and deletes it. No pod goes to
        it afterwards (`set_nodes` brings nodes back). Answers once that is done, with the
        `namespace/name` of the pods collected."""
        return list(self._slow_post(f"/_emulator/nodes/{node_name}/lose", {})["collected"])

    def end_watches(self) -> int:
        """End every open watch stream cleanly, as the API server does at a watch's
        timeout (the client must watch again). How many there were."""
        return int(self._post("/_emulator/watches/end", {})["ended"])

    def expire_watches(self) -> int:
        """Make every resourceVersion handed out so far too old (as etcd's compaction):
        each open watch gets one ERROR event, a Status 410 Expired, and ends; a new watch
        from such a version gets the same in its 200 stream. How many watches were open."""
        return int(self._post("/_emulator/watches/expire", {})["expired"])

    def set_nodes(self, nodes: list[dict[str, Any]]) -> None:
        """Replace the nodes: `{"name", "labels", "allocatable", "taints"}` each."""
        self._post("/_emulator/nodes", {"nodes": nodes})

    def drop_next(self, n: int, verb: str | None = None, resource: str | None = None) -> None:
        """The next `n` API requests (of `verb` on `resource`, when given) get no answer:
        their connection is closed (the client sees a transport error)."""
        self._post("/_emulator/faults", {"n": n, "drop": True, "verb": verb, "resource": resource})

    def fail_next(
        self,
        n: int,
        code: int,
        verb: str | None = None,
        resource: str | None = None,
        *,
        retry_after: int = 1,
        message: str | None = None,
        after: bool = False,
    ) -> None:
        """The next `n` API requests (of `verb` on `resource`, when given) answer `code`
        (429 with Retry-After, 500, 503, ...) as a real Status; with `after`, each is
        carried out first and only its answer is lost."""
        self._post(
            "/_emulator/faults",
            {
                "n": n,
                "code": code,
                "verb": verb,
                "resource": resource,
                "retry_after": retry_after,
                "message": message,
                "after": after,
            },
        )

    def clear_faults(self) -> None:
        self._post("/_emulator/faults", {"clear": True})

    def set_unpullable(self, images: list[str] | set[str]) -> None:
        self._post("/_emulator/unpullable", {"images": sorted(images)})

    def set_node_groups(self, groups: list[dict[str, Any]]) -> None:
        """The cluster autoscaler's node groups: `{"name", "template": {"labels",
        "allocatable"}, "maxSize", "delaySeconds"}` each. A pod unschedulable that fits a
        template gets TriggeredScaleUp and its node after delaySeconds on the emulator's
        clock (`advance_clock`); one no group can help, NotTriggerScaleUp."""
        self._post("/_emulator/node-groups", {"groups": groups})

    def events(self, namespace: str = "openalice") -> list[dict[str, Any]]:
        """The events in `namespace` (the autoscaler's), as the API holds them."""
        return list(self._get("/_emulator/objects/events", namespace=namespace))

    def set_flaky_pulls(self, images: dict[str, int]) -> None:
        """Each pod's first n pulls of an image fail as a registry's rate limit does
        (ErrImagePull, then ImagePullBackOff until the backoff ends: `advance_clock`
        ends it); the next pull succeeds."""
        self._post("/_emulator/flaky-pulls", {"images": images})

    def pause_kubelet(self) -> None:
        """Pods are still scheduled, but no container starts until `resume_kubelet`."""
        self._post("/_emulator/kubelet", {"paused": True})

    def resume_kubelet(self) -> None:
        self._post("/_emulator/kubelet", {"paused": False})

    def set_rbac(self, rules: list[dict[str, Any]] | None) -> None:
        """Role rules (`{apiGroups, resources, verbs}`) the token is bound to; None: all."""
        self._post("/_emulator/rbac", {"rules": rules})

    def add_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        """One more namespace, with `labels` (e.g. Pod Security's
        `pod-security.kubernetes.io/enforce: restricted`)."""
        self._post("/_emulator/namespaces", {"name": name, "labels": labels or {}})

    def add_priority_class(self, name: str, value: int) -> None:
        """A PriorityClass pods may name (besides the two system ones)."""
        self._post("/_emulator/priorityclasses", {"name": name, "value": value})

    def sync(self) -> None:
        """Return after one whole kubelet pass."""
        self._post("/_emulator/sync", {})

    def _slow_post(self, path: str, body: dict[str, Any]) -> Any:
        """A control call that waits for containers to stop (grace periods): a longer
        timeout than the others'."""
        response = self._client().post(path, json=body, timeout=_SLOW_CALL_SECONDS)
        if response.status_code >= 400:
            raise ValueError(f"{path} refused {body}: {response.status_code} {response.text}")
        return response.json()
