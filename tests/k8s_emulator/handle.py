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
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import docker
import docker.errors
import httpx

from .runtime import LABEL_INSTANCE

REPO = Path(__file__).resolve().parents[2]
_START_TIMEOUT = 60.0
_STOP_TIMEOUT = 30.0


def _free_port() -> int:
    try:  # the test suite's own port blocks, when run by it
        from tests.harness import free_port
    except ImportError:  # pragma: no cover - used outside the suite
        return 0
    return free_port()


class KubeEmulator:
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
        self.instance = "k" + secrets.token_hex(5)
        self.network = network
        self.log_path = log_path
        self.token = token or "kt-" + secrets.token_urlsafe(24)
        self.namespaces = namespaces
        self.nodes = nodes
        self.rbac = rbac
        self.log_level = log_level
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self._http: httpx.Client | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="k8s-emulator-handle-"))

    # --- process -----------------------------------------------------------------------

    @property
    def server_url(self) -> str:
        """`https://127.0.0.1:<port>`: the cluster's API server."""
        return str(self.info["server_url"])

    @property
    def control_url(self) -> str:
        return str(self.info["control_url"])

    @property
    def ca_file(self) -> str:
        return str(self.info["ca_file"])

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

    def start(self) -> KubeEmulator:
        if self.proc is not None:
            raise RuntimeError("the Kubernetes emulator is already running")
        command = [
            sys.executable,
            "-m",
            "tests.k8s_emulator",
            "--port",
            str(_free_port()),
            "--control-port",
            str(_free_port()),
            "--instance",
            self.instance,
            "--state-dir",
            str(self._dir / "state"),
            "--exit-with-parent",
            "--log-level",
            self.log_level,
            *(["--network", self.network] if self.network else []),
            *[arg for ns in self.namespaces for arg in ("--namespace", ns)],
            *(["--nodes", json.dumps(self.nodes)] if self.nodes is not None else []),
            *(["--rbac", json.dumps(self.rbac)] if self.rbac is not None else []),
            *self.extra_args,
        ]
        env = {**os.environ, "K8S_EMULATOR_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log
            )
        finally:
            if not isinstance(log, int):
                log.close()
        try:
            self.info = self._read_ready_line()
            self._http = httpx.Client(base_url=self.control_url, timeout=60)
            self._wait_answering()
            self.write_kubeconfig(self.kubeconfig_path)
        except BaseException:
            self.stop()
            raise
        return self

    def _read_ready_line(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        lines: list[bytes] = []
        reader = threading.Thread(target=lambda: lines.append(self.proc.stdout.readline()))  # type: ignore[union-attr]
        reader.daemon = True
        reader.start()
        reader.join(_START_TIMEOUT)
        if not lines or not lines[0]:
            raise RuntimeError(f"the Kubernetes emulator did not start ({self._exit_note()})")
        return dict(json.loads(lines[0]))

    def _wait_answering(self) -> None:
        assert self._http is not None
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if self._http.get("/_emulator/healthz").status_code == 200:
                    return
            time.sleep(0.05)
        raise RuntimeError("the Kubernetes emulator's control API does not answer")

    def _exit_note(self) -> str:
        code = self.proc.poll() if self.proc else None
        note = "still running" if code is None else f"exited {code}"
        if self.log_path and self.log_path.exists():
            note += ":\n" + self.log_path.read_text(errors="replace")[-4000:]
        return note

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(_STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        if self._http is not None:
            self._http.close()
            self._http = None
        self.remove_leftovers()
        shutil.rmtree(self._dir, ignore_errors=True)

    def remove_leftovers(self) -> int:
        """Remove the instance's containers and network (by label); how many containers."""
        client = docker.from_env(timeout=60)
        try:
            label = f"{LABEL_INSTANCE}={self.instance}"
            found = client.api.containers(all=True, filters={"label": label})
            for entry in found:
                with contextlib.suppress(docker.errors.NotFound):
                    client.api.remove_container(entry["Id"], force=True)
            for network in client.networks.list(filters={"label": label}):
                with contextlib.suppress(docker.errors.APIError):
                    network.remove()
            return len(found)
        finally:
            client.close()

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # --- control -----------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        if self._http is None:
            raise RuntimeError("the Kubernetes emulator is not running")
        return self._http

    def _get(self, path: str, **params: Any) -> Any:
        response = self._client().get(path, params={k: v for k, v in params.items() if v})
        response.raise_for_status()
        return response.json()

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        response = self._client().post(path, json=body)
        if response.status_code >= 400:
            raise ValueError(f"{path} refused {body}: {response.status_code} {response.text}")
        return response.json() if response.content else None

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
        `namespace/name` of the pods that it ended by their deadline."""
        return list(self._post("/_emulator/clock", {"advance": seconds})["ended"])

    def set_nodes(self, nodes: list[dict[str, Any]]) -> None:
        """Replace the nodes: `{"name", "labels", "allocatable"}` each."""
        self._post("/_emulator/nodes", {"nodes": nodes})

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

    def pause_kubelet(self) -> None:
        """Pods are still scheduled, but no container starts until `resume_kubelet`."""
        self._post("/_emulator/kubelet", {"paused": True})

    def resume_kubelet(self) -> None:
        self._post("/_emulator/kubelet", {"paused": False})

    def set_rbac(self, rules: list[dict[str, Any]] | None) -> None:
        """Role rules (`{apiGroups, resources, verbs}`) the token is bound to; None: all."""
        self._post("/_emulator/rbac", {"rules": rules})

    def add_namespace(self, name: str) -> None:
        self._post("/_emulator/namespaces", {"name": name})

    def sync(self) -> None:
        """Return after one whole kubelet pass."""
        self._post("/_emulator/sync", {})
