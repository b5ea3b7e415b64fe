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

import secrets
from pathlib import Path
from typing import Any

from tests.emulator_process import EmulatorProcess

from .containers import LABEL_INSTANCE


class ModalEmulator(EmulatorProcess):
    """`server_url`: `http://127.0.0.1:<port>`, for `MODAL_SERVER_URL`; `ca_file`: for
    `SSL_CERT_FILE` of whoever calls a tunnel."""

    title = "the Modal emulator"
    module = "tests.modal_emulator"
    instance_label = LABEL_INSTANCE
    stop_timeout = 20.0

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
        super().__init__(
            "t" + secrets.token_hex(5), log_path, network=network, extra_args=extra_args
        )
        self.token_id = token_id or "ak-" + secrets.token_hex(8)
        self.token_secret = token_secret or "as-" + secrets.token_hex(16)
        self.tunnel_host = tunnel_host

    # --- process -----------------------------------------------------------------------

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

    def own_arguments(self) -> list[str]:
        return ["--tunnel-host", self.tunnel_host]

    def environment(self) -> dict[str, str]:
        return {
            "MODAL_EMULATOR_TOKEN_ID": self.token_id,
            "MODAL_EMULATOR_TOKEN_SECRET": self.token_secret,
        }

    # --- control -----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return dict(self._get("/_emulator/state"))

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

    def hold_tunnels(self, held: bool = True) -> None:
        """Running sandboxes' tunnels are not reported (`tunnels()` waits, then
        `SandboxTimeoutError`) until `hold_tunnels(False)`."""
        self.switch(hold_tunnels=held)

    def set_no_capacity(self, enabled: bool = True, *, gpu: str = "*") -> None:
        """Refuse creates (RESOURCE_EXHAUSTED) asking for `gpu` ("*": all, "": no GPU)."""
        refused = set(self.state()["settings"]["no_capacity"])
        refused = refused | {gpu} if enabled else refused - {gpu}
        self.switch(no_capacity=sorted(refused))

    def set_max_sandboxes(self, limit: int | None) -> None:
        """At most `limit` sandboxes placed (scheduling or running) at once; a create past
        it succeeds and its sandbox waits in a queue (no task, no container) until a
        placed one ends, oldest first. `None`: no limit."""
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
        """Move the emulator's clock; the ids of sandboxes that ended by their deadline.
        Real time moves the clock too unless it is frozen (`freeze_clock`)."""
        return list(self._post("/_emulator/clock", {"advance": seconds})["ended"])

    def freeze_clock(self, frozen: bool = True) -> None:
        """Stop real time's part in the emulator's clock (`False`: restart it): only
        `advance_clock` moves it then, so `advance_clock(n)` ends exactly the sandboxes
        due within `n` seconds, however slowly the test ran. `reset` unfreezes it."""
        self._post("/_emulator/clock", {"frozen": frozen})

    def oom_kill(self, sandbox_id: str) -> dict[str, Any]:
        """The kernel OOM-kills the sandbox's container at its memory limit (SIGKILL,
        really): it ends as Modal records it (KERNEL_OOM_KILL, exit code 137); its
        result (`status`, `returncode`, `exception`). Refused (ValueError) for a sandbox
        not running, or without a memory limit (`memory=(request, limit)`)."""
        path = f"/_emulator/sandboxes/{sandbox_id}/oom-kill"
        return dict(self._post(path, {})["result"])

    def reset(self) -> None:
        self._post("/_emulator/reset", {})
