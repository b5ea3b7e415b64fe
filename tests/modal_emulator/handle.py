"""`ModalEmulator`: the emulator as a subprocess, and the test's handle on it.

    with ModalEmulator(network="oa-modal-test") as modal:
        modal.set_no_capacity(gpu="L4")
        env = modal.client_env()      # MODAL_SERVER_URL, MODAL_TOKEN_*, SSL_CERT_FILE
        ...                           # drive the modal client / the scheduler
        assert modal.sandboxes()[0]["gpu"] == "L4"

It starts `python -m tests.modal_emulator` on free ports, waits until it answers, and
on exit stops it and removes every container (and the network) of its instance by
label, also when the process died without doing so.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import docker
import docker.errors
import httpx

from .containers import LABEL_INSTANCE

REPO = Path(__file__).resolve().parents[2]
_START_TIMEOUT = 60.0
_STOP_TIMEOUT = 20.0


def _free_port() -> int:
    try:  # the test suite's own port blocks, when run by it
        from tests.harness import free_port
    except ImportError:  # pragma: no cover - used outside the suite
        return 0
    return free_port()


class ModalEmulator:
    def __init__(
        self,
        *,
        network: str | None = None,
        token_id: str | None = None,
        token_secret: str | None = None,
        tunnel_host: str = "127.0.0.1",
        log_path: Path | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.instance = "t" + secrets.token_hex(5)
        self.network = network
        self.token_id = token_id or "ak-" + secrets.token_hex(8)
        self.token_secret = token_secret or "as-" + secrets.token_hex(16)
        self.tunnel_host = tunnel_host
        self.log_path = log_path
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self._http: httpx.Client | None = None

    # --- process -----------------------------------------------------------------------

    @property
    def server_url(self) -> str:
        """For `MODAL_SERVER_URL`."""
        return str(self.info["server_url"])

    @property
    def control_url(self) -> str:
        return str(self.info["control_url"])

    @property
    def ca_file(self) -> str:
        """The emulator's CA (PEM), for `SSL_CERT_FILE` of whoever calls a tunnel."""
        return str(self.info["ca_file"])

    @property
    def network_gateway(self) -> str | None:
        """The host's address on the sandboxes' network (for a scheduler's public URL that
        its workers in sandboxes reach)."""
        gateway = self.info.get("network_gateway")
        return str(gateway) if gateway else None

    def client_env(self) -> dict[str, str]:
        """The environment a process with the `modal` client needs to use the emulator."""
        return {
            "MODAL_SERVER_URL": self.server_url,
            "MODAL_TOKEN_ID": self.token_id,
            "MODAL_TOKEN_SECRET": self.token_secret,
            "SSL_CERT_FILE": self.ca_file,
            "REQUESTS_CA_BUNDLE": self.ca_file,
        }

    def start(self) -> ModalEmulator:
        if self.proc is not None:
            raise RuntimeError("the Modal emulator is already running")
        command = [
            sys.executable,
            "-m",
            "tests.modal_emulator",
            "--port",
            str(_free_port()),
            "--control-port",
            str(_free_port()),
            "--instance",
            self.instance,
            "--tunnel-host",
            self.tunnel_host,
            "--exit-with-parent",
            *(["--network", self.network] if self.network else []),
            *self.extra_args,
        ]
        env = {
            **os.environ,
            "MODAL_EMULATOR_TOKEN_ID": self.token_id,
            "MODAL_EMULATOR_TOKEN_SECRET": self.token_secret,
            "PYTHONUNBUFFERED": "1",
        }
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
            raise RuntimeError(f"the Modal emulator did not start ({self._exit_note()})")
        return dict(json.loads(lines[0]))

    def _wait_answering(self) -> None:
        assert self._http is not None
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            try:
                if self._http.get("/_emulator/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the Modal emulator's control API does not answer")

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

    def __enter__(self) -> ModalEmulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # --- control -----------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        if self._http is None:
            raise RuntimeError("the Modal emulator is not running")
        response = self._http.post(path, json=body)
        if response.status_code >= 400:
            raise ValueError(f"{path} refused {body}: {response.status_code} {response.text}")
        return response.json() if response.content else None

    def state(self) -> dict[str, Any]:
        if self._http is None:
            raise RuntimeError("the Modal emulator is not running")
        response = self._http.get("/_emulator/state")
        response.raise_for_status()
        return dict(response.json())

    def sandboxes(self) -> list[dict[str, Any]]:
        """What each sandbox asked for (env keys, never values), oldest first."""
        return list(self.state()["sandboxes"])

    def sandbox(self, sandbox_id: str) -> dict[str, Any]:
        for record in self.sandboxes():
            if record["sandbox_id"] == sandbox_id:
                return record
        raise KeyError(sandbox_id)

    def calls(self, rpc: str | None = None) -> list[dict[str, Any]]:
        return [c for c in self.state()["calls"] if rpc is None or c["rpc"] == rpc]

    def switch(self, **switches: Any) -> dict[str, Any]:
        """Set switches as `POST /_emulator/switches` takes them (README)."""
        return dict(self._post("/_emulator/switches", switches))

    def set_schedule_delay(self, seconds: float) -> None:
        self.switch(schedule_delay=seconds)

    def set_no_capacity(self, enabled: bool = True, *, gpu: str = "*") -> None:
        """Refuse creates (RESOURCE_EXHAUSTED) asking for `gpu` ("*": all, "": no GPU)."""
        refused = set(self.state()["settings"]["no_capacity"])
        refused = refused | {gpu} if enabled else refused - {gpu}
        self.switch(no_capacity=sorted(refused))

    def set_max_sandboxes(self, limit: int | None) -> None:
        self.switch(max_sandboxes=limit)

    def set_list_page_size(self, size: int) -> None:
        self.switch(list_page_size=size)

    def set_rpc_delay(self, rpc: str, seconds: float) -> None:
        self.switch(rpc_delay={rpc: seconds})

    def fail_next(
        self,
        rpc: str,
        *,
        calls: int = 1,
        status: str = "UNAVAILABLE",
        message: str | None = None,
        per_attempt: bool = False,
    ) -> None:
        """The next `calls` calls of `rpc` (fnmatch pattern) answer `status`; a call's
        retries by the client fail with it unless `per_attempt`."""
        fault: dict[str, Any] = {
            "rpc": rpc,
            "calls": calls,
            "status": status,
            "per_attempt": per_attempt,
        }
        if message is not None:
            fault["message"] = message
        self.switch(fail_next=[fault])

    def fail_terminate_once(self, status: str = "UNAVAILABLE") -> None:
        """The next `Sandbox.terminate` (either generation) fails, retries included, and
        the sandbox keeps running."""
        self.fail_next("SandboxTerminate*", status=status)

    def advance_clock(self, seconds: float) -> list[str]:
        """Move the emulator's clock; the ids of sandboxes that ended by their deadline."""
        return list(self._post("/_emulator/clock", {"advance": seconds})["ended"])

    def reset(self) -> None:
        self._post("/_emulator/reset", {})
