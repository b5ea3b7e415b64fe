"""A watch on the shared Docker engine, kept by the test session's controller: when the
engine's network controller stops answering, the run stops two to three minutes later
and says why, instead of every test left waiting out its 180 s timeout (hours, for the suite).

Docker 20.10 before 20.10.27 can deadlock so (moby/moby#46661; tests/README.md, "A hang"):
`GET /networks`, and every call that makes, joins or removes a network, never answers,
while `docker ps` still does. So the watch asks `GET /networks` every `interval` seconds,
and gives each ask `patience` seconds, far more than it takes on a loaded machine (well
under a second). `strikes` asks in a row with no answer end the run: the reason goes to
stderr, every process the run started (pytest-xdist's workers and, below them, the
schedulers, emulators, private engines and databases) gets SIGTERM and, `grace` seconds
later, SIGKILL, and the session exits 2 (interrupted). An engine that refuses connections
is not this: the tests fail at once then, and the watch says nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import suppress

import httpx
import pytest

from tests.harness import SHARED_ENGINE
from tests.procs import descendants, running

SOCKET = SHARED_ENGINE.removeprefix("unix://")
INTERVAL = 10.0
PATIENCE = 60.0
STRIKES = 2
GRACE = 10.0


class EngineWatch:
    """Asks `socket`'s engine for its networks until `stop()`; calls `on_stuck(reason)`
    once, from its thread, after `strikes` asks in a row went unanswered."""

    def __init__(
        self,
        socket: str,
        on_stuck: Callable[[str], None],
        *,
        interval: float = INTERVAL,
        patience: float = PATIENCE,
        strikes: int = STRIKES,
    ) -> None:
        self.socket = socket
        self.on_stuck = on_stuck
        self.interval, self.patience, self.strikes = interval, patience, strikes
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="engine-watch", daemon=True)

    def start(self) -> EngineWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def answers(self, path: str = "/networks", patience: float | None = None) -> bool:
        """True when the engine answered `path` within `patience` seconds (or refused the
        connection: no engine at all is not a stuck one)."""
        transport = httpx.HTTPTransport(uds=self.socket)
        with httpx.Client(transport=transport, timeout=patience or self.patience) as client:
            try:
                client.get(f"http://engine/v1.41{path}")
            except httpx.TimeoutException:
                return False
            except httpx.TransportError:
                return True
        return True

    def _watch(self) -> None:
        missed = 0
        while not self._stopped.wait(self.interval):
            missed = 0 if self.answers() else missed + 1
            if missed >= self.strikes and not self._stopped.is_set():
                self.on_stuck(self._reason(missed))
                return

    def _reason(self, missed: int) -> str:
        others = (
            "`GET /version` still answers (as `docker ps` does)"
            if self.answers("/version", patience=min(5, self.patience))
            else "`GET /version` does not answer either"
        )
        return (
            f"The Docker engine at {self.socket} has not answered `GET /networks` "
            f"{missed} times in a row, {self.patience:.0f} s each; {others}. Its network "
            "controller is most likely deadlocked, as Docker 20.10 before 20.10.27 can be "
            "(moby/moby#46661). The run is stopped: every test left would wait out its "
            "timeout. To clear the engine: `pkill dockerd; scripts/ensure-docker.sh`, then "
            'remove the containers and `oa-*` networks left (tests/README.md, "A hang").'
        )


def stop_everything_below(root: int, grace: float = GRACE, workers: bool = False) -> None:
    """SIGTERM to every process below `root`, SIGKILL to those still running `grace`
    seconds later (their parents may have ended: each is known by its pid and start
    time). All are stopped (SIGSTOP) first, again until no new one appears, so none
    forks a child that would be missed. With `workers` (pytest-xdist's, the children of
    `root`), those stay stopped until their SIGKILL: a worker seen to end meanwhile would
    be replaced by a new one."""
    held: dict[int, tuple[str, int]] = {}
    while found := {pid: seen for pid, seen in descendants(root).items() if pid not in held}:
        for pid in found:
            _signal(pid, signal.SIGSTOP)
        held.update(found)
    frozen = {pid for pid, (_, parent) in held.items() if workers and parent == root}
    for pid in held.keys() - frozen:
        _signal(pid, signal.SIGTERM)
        _signal(pid, signal.SIGCONT)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(
        running(pid, start) for pid, (start, _) in held.items() if pid not in frozen
    ):
        # sleep: between two looks at /proc; another process's end is no event here.
        time.sleep(0.1)
    for pid, (start, _) in held.items():
        if running(pid, start):
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


# A test of this watch points it at another socket (a fault proxy's), on its own times.
SOCKET_ENV = "OPENALICE_TEST_ENGINE_SOCKET"
TIMES_ENV = "OPENALICE_TEST_ENGINE_WATCH"  # "INTERVAL,PATIENCE,STRIKES,GRACE"
_WATCH = pytest.StashKey[EngineWatch]()


def pytest_configure(config: pytest.Config) -> None:
    """In the controller (or a run without workers): watch the engine the tests use."""
    if hasattr(config, "workerinput"):
        return
    times = [float(part) for part in os.environ.get(TIMES_ENV, "").split(",") if part]
    interval, patience, strikes, grace = times or [INTERVAL, PATIENCE, STRIKES, GRACE]
    config.stash[_WATCH] = EngineWatch(
        os.environ.get(SOCKET_ENV, SOCKET),
        end_session(config, grace),
        interval=interval,
        patience=patience,
        strikes=int(strikes),
    ).start()


def pytest_unconfigure(config: pytest.Config) -> None:
    if watch := config.stash.get(_WATCH, None):
        watch.stop()


def end_session(config: pytest.Config, grace: float) -> Callable[[str], None]:
    """What the controller does when the engine is stuck: say why (past pytest's
    capture, which holds stderr in a run without workers), stop every process below it,
    and exit 2."""

    def on_stuck(reason: str) -> None:
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.suspend_global_capture(in_=True)
        sys.stderr.write(f"\n{'!' * 30} engine watch {'!' * 30}\n{reason}\n")
        sys.stderr.flush()
        workers = config.pluginmanager.has_plugin("dsession")  # pytest-xdist's controller
        stop_everything_below(os.getpid(), grace, workers)
        os._exit(pytest.ExitCode.INTERRUPTED)

    return on_stuck
