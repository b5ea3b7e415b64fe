"""`RunPodEmulator`: the emulator's state plus a real uvicorn server on loopback.

The server runs in a background thread with its own event loop, so synchronous tests and
async code under test can both talk to it over real HTTP. The socket is bound before the
thread starts, which makes the ephemeral port known (and `base_url` valid) without a race.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from tests.emulator_common import LOOPBACK, Served, loopback_socket

from .app import build_app
from .openapi import OpenApiSchemas
from .state import EmulatorState

DEFAULT_API_KEY = "emulator-test-key"
_START_TIMEOUT = 10.0
_STOP_TIMEOUT = 5.0


class RunPodEmulator(EmulatorState, Served):
    """A RunPod API (REST v2 + GraphQL) on `http://127.0.0.1:<port>`.

    The emulator *is* its control panel: every fault switch of `EmulatorState`
    (`fail_next`, `set_no_capacity`, `provision_delay`, ...) is a method or attribute of
    this object and is safe to call from the test thread while the server runs.
    """

    def __init__(
        self,
        api_key: str = DEFAULT_API_KEY,
        *,
        port: int = 0,
        provision_delay: float = 0.0,
    ) -> None:
        super().__init__(provision_delay=provision_delay)
        self.api_key = api_key
        self._requested_port = port
        self._schemas = OpenApiSchemas.load()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the emulator is not running; call start() first")
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def proxy_url(self) -> str:
        """The template of a pod's proxy URL here (the scheduler's RUNPOD_PROXY_URL):
        see `pods_answer_after` and proxy.py."""
        return f"{self.base_url}/_proxy/{{pod_id}}-{{port}}"

    @property
    def schemas(self) -> OpenApiSchemas:
        """What request bodies are validated against (its `path`: the repository's file)."""
        return self._schemas

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def start(self) -> RunPodEmulator:
        if self._thread is not None:
            raise RuntimeError("the emulator is already running")
        sock = loopback_socket(self._requested_port)
        config = uvicorn.Config(
            build_app(self, self.api_key, self._schemas),
            log_config=None,  # leave the test process's logging configuration alone
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            timeout_graceful_shutdown=1,
        )
        server = uvicorn.Server(config)
        thread = threading.Thread(
            target=server.run, kwargs={"sockets": [sock]}, name="runpod-emulator", daemon=True
        )
        self._server, self._thread, self._port = server, thread, sock.getsockname()[1]
        thread.start()
        self._wait_started(server, thread)
        return self

    def stop(self) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(_STOP_TIMEOUT)
        if thread.is_alive():  # a slow answer still in flight: do not wait for it
            server.force_exit = True
            thread.join(_STOP_TIMEOUT)
        self._server = self._thread = self._port = None

    def _wait_started(self, server: uvicorn.Server, thread: threading.Thread) -> None:
        # uvicorn exposes no start event, only a flag: poll it briefly.
        deadline = time.monotonic() + _START_TIMEOUT
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            self.stop()
            raise RuntimeError("the RunPod emulator did not start")
