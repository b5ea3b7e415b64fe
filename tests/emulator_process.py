"""What the suite's emulators of clouds (modal_emulator/, k8s_emulator/) share as
processes: on the emulator's side, its common options and configuration (`arguments`,
`ServerConfig`), its ready line (`print_ready`), serving until SIGINT, SIGTERM or the end
of the process that started it (`run_until_stopped`); on the test's side, the handle that
starts it, waits until it answers and stops it (`EmulatorProcess`).

An emulator is `python -m <module> …`: it prints one JSON line on stdout once it serves
(with `control_url`, its control API, which answers `GET /_emulator/healthz`), and
labels every Docker container and network it makes with its instance, so that all of
them are found and removed by label, also after it died without doing so. What they share
as servers is in emulator_common.py."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import docker
import docker.errors
import httpx

from tests.emulator_common import Served

REPO = Path(__file__).resolve().parents[1]
_START_TIMEOUT = 60.0


# --- the emulator's side -------------------------------------------------------------------


def arguments(
    module: str, description: str | None, api: str, workers: str
) -> argparse.ArgumentParser:
    """The command line every emulator takes (`--port` of its `api`, `--control-port`,
    `--network` of its `workers`' containers, `--instance`, `--state-dir`,
    `--exit-with-parent`, `--log-level`); the emulator adds its own."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--port", type=int, default=0, help=f"{api} port on 127.0.0.1 (0: any)")
    parser.add_argument("--control-port", type=int, default=0, help="control API port (0: any)")
    parser.add_argument(
        "--network",
        default=None,
        help=f"Docker network of the {workers}' containers (made if missing, and then removed "
        "at exit); default: Docker's default bridge",
    )
    parser.add_argument("--instance", default=None, help="label value of its containers")
    parser.add_argument("--state-dir", type=Path, default=None, help="for the CA (default: temp)")
    parser.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop (and remove its containers) when the process that started it is gone",
    )
    parser.add_argument("--log-level", default="WARNING")
    return parser


@dataclass(kw_only=True)
class ServerConfig:
    """What every emulator serves with, from the options of `arguments`; an emulator's
    own configuration adds its fields."""

    instance: str
    state_dir: Path
    network: str | None = None
    port: int = 0
    control_port: int = 0

    @classmethod
    def from_arguments(cls, args: argparse.Namespace, state_prefix: str, **own: Any) -> Self:
        """From the parsed command line (an instance and a temporary state directory,
        named `state_prefix…`, made up when not given), with the emulator's `own`
        fields."""
        return cls(
            instance=args.instance or secrets.token_hex(5),
            state_dir=args.state_dir or Path(tempfile.mkdtemp(prefix=state_prefix)),
            network=args.network,
            port=args.port,
            control_port=args.control_port,
            **own,
        )


def print_ready(made_up: dict[str, str]) -> Callable[[dict[str, Any]], None]:
    """The `ready(info)` of an emulator's server: `info` as the one JSON line on stdout
    that the test's handle waits for, with the secrets the emulator `made_up` (those the
    process that started it did not give it, which nothing else tells)."""

    def ready(info: dict[str, Any]) -> None:
        print(json.dumps({**info, **made_up}), flush=True)

    return ready


def log_to_stderr(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


def run_until_stopped(
    serve: Callable[[asyncio.Event], Awaitable[None]], exit_with_parent: bool
) -> None:
    """Run `serve(stop)` until `stop` is set: by SIGINT or SIGTERM, or, with
    `exit_with_parent`, once the process that started this one is gone (a test process
    killed -9 leaves no emulator behind)."""

    def watch_parent(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> int:
        """Set `stop` once the parent is gone: a pidfd of the parent turns readable when it
        ends (Linux 5.3 and later), an event of the kernel rather than a poll."""
        parent = os.getppid()
        pidfd = os.pidfd_open(parent)

        def gone() -> None:
            loop.remove_reader(pidfd)  # readable from now on: heard once is enough
            stop.set()

        loop.add_reader(pidfd, gone)
        if os.getppid() != parent:  # gone before the pidfd was opened: that one is another's
            stop.set()
        return pidfd

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        pidfd = watch_parent(loop, stop) if exit_with_parent else None
        try:
            await serve(stop)
        finally:
            if pidfd is not None:
                loop.remove_reader(pidfd)
                os.close(pidfd)

    asyncio.run(run())


# --- the test's side -----------------------------------------------------------------------


def free_port() -> int:
    try:  # the test suite's own port blocks, when run by it
        from tests.harness import free_port as suite_port
    except ImportError:  # pragma: no cover - used outside the suite
        return 0
    return suite_port()


class EmulatorProcess(Served):
    """The handle on one emulator process. A subclass names it (`title`, `module`, the
    Docker label of its instance, `instance_label`), gives its own options
    (`own_arguments()`) and `environment()`, and may act once it answers (`started`) and
    once it is gone (`stopped`). Every emulator serves its API at `server_url`, with
    certificates of its own CA (`ca_file`), and runs its containers on `network`."""

    title = "the emulator"
    module = ""
    instance_label = ""
    stop_timeout = 20.0

    def __init__(
        self,
        instance: str,
        log_path: Path | None,
        *,
        network: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.instance = instance
        self.log_path = log_path
        self.network = network
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self._http: httpx.Client | None = None

    def arguments(self) -> list[str]:
        """The command line after `python -m <module>`: the options of every emulator
        (`arguments` above), the emulator's own, then `extra_args`."""
        return [
            "--port",
            str(free_port()),
            "--control-port",
            str(free_port()),
            "--instance",
            self.instance,
            "--exit-with-parent",
            *(["--network", self.network] if self.network else []),
            *self.own_arguments(),
            *self.extra_args,
        ]

    def own_arguments(self) -> list[str]:
        """The options of this emulator only."""
        return []

    def environment(self) -> dict[str, str]:
        """What the process gets in its environment besides the test's own (secrets:
        never on a command line)."""
        return {}

    def started(self) -> None:
        """Called once the emulator answers."""

    def stopped(self) -> None:
        """Called once the emulator and everything it made are gone."""

    @property
    def server_url(self) -> str:
        """`http(s)://127.0.0.1:<port>`: the emulated API, for its client."""
        return str(self.info["server_url"])

    @property
    def ca_file(self) -> str:
        """The emulator's CA (PEM), which signed the certificates it serves with."""
        return str(self.info["ca_file"])

    @property
    def control_url(self) -> str:
        return str(self.info["control_url"])

    # --- process -----------------------------------------------------------------------

    def start(self) -> Self:
        if self.proc is not None:
            raise RuntimeError(f"{self.title} is already running")
        command = [sys.executable, "-m", self.module, *self.arguments()]
        env = {**os.environ, **self.environment(), "PYTHONUNBUFFERED": "1"}
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
            self.started()
        except BaseException:
            self.stop()
            raise
        return self

    def _read_ready_line(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        stdout = self.proc.stdout
        lines: list[bytes] = []
        reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(_START_TIMEOUT)
        if not lines or not lines[0]:
            raise RuntimeError(f"{self.title} did not start ({self._exit_note()})")
        return dict(json.loads(lines[0]))

    def _wait_answering(self) -> None:
        # The ready line is printed once the control API listens: it answers the first
        # request, there is nothing to poll for.
        assert self._http is not None
        try:
            answer = self._http.get("/_emulator/healthz", timeout=_START_TIMEOUT)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"{self.title}'s control API does not answer: {exc!r}") from None
        if answer.status_code != 200:
            raise RuntimeError(f"{self.title}'s control API answers {answer.status_code}")

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
                    proc.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        if self._http is not None:
            self._http.close()
            self._http = None
        self.remove_leftovers()
        self.stopped()

    def remove_leftovers(self) -> int:
        """Remove the instance's containers and network (by label); how many containers."""
        client = docker.from_env(timeout=60)
        try:
            label = f"{self.instance_label}={self.instance}"
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

    # --- control -----------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        if self._http is None:
            raise RuntimeError(f"{self.title} is not running")
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
