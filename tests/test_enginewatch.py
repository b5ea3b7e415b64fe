"""The test session's watch on the Docker engine (tests/enginewatch.py): a run whose engine
stops answering `GET /networks` (Docker 20.10's deadlock, moby/moby#46661) ends within
seconds of its times, saying why, with nothing it started left running; a run whose
engine answers is left alone."""

from __future__ import annotations

import os
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from tests.enginewatch import SOCKET, SOCKET_ENV, TIMES_ENV, EngineWatch
from tests.harness import REPO, wait_for


class FakeEngine(socketserver.ThreadingUnixStreamServer):
    """An engine's socket that answers every call with `[]` until `stall()`, then reads
    each call and never answers it: what dockerd's API does once deadlocked."""

    daemon_threads = True

    def __init__(self, path: Path) -> None:
        self.stalled = threading.Event()
        self.closing = threading.Event()
        self.asked: list[str] = []
        super().__init__(str(path), _Answer)

    def stall(self) -> None:
        self.stalled.set()


class _Answer(BaseHTTPRequestHandler):
    server: FakeEngine

    def do_GET(self) -> None:
        self.server.asked.append(self.path)
        if self.server.stalled.is_set():
            self.server.closing.wait()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"[]")

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def fake_engine(tmp_path: Path) -> Iterator[FakeEngine]:
    engine = FakeEngine(tmp_path / "engine.sock")
    thread = threading.Thread(target=engine.serve_forever, daemon=True)
    thread.start()
    try:
        yield engine
    finally:
        engine.closing.set()
        engine.shutdown()
        engine.server_close()


INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\n"

# Two tests that would hang for five minutes, each starting a child that ignores SIGTERM
# and writing its own pid and the child's to a file.
HANGING = """
import os, subprocess, time
from pathlib import Path

def hang(name):
    child = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 300"])
    Path(name + ".pid").write_text(f"{os.getpid()} {child.pid}")
    time.sleep(300)

def test_one():
    hang("one")

def test_two():
    hang("two")
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("workers", [2, 0])
def test_a_run_whose_engine_stops_answering_ends_saying_why_and_leaves_nothing_running(
    tmp_path: Path, fake_engine: FakeEngine, workers: int
) -> None:
    """In a run with pytest-xdist's workers (each running a test) and in one without (the
    test in the controller itself, its output captured by pytest)."""
    (tmp_path / "test_hanging.py").write_text(HANGING)
    # An ini file of its own: none of the suite's options (its six workers, say).
    (tmp_path / "pytest.ini").write_text(INI)
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "tests.enginewatch", "-p", "no:cacheprovider"]
        + ["-n", str(workers)],
        cwd=tmp_path,
        env={
            # not this worker's PYTEST_XDIST_WORKER and the like: a session of its own
            **{name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")},
            "PYTHONPATH": str(REPO),
            SOCKET_ENV: fake_engine.server_address,  # type: ignore[dict-item]
            # every 0.2 s; 1 s of patience; two misses; 2 s of grace before SIGKILL
            TIMES_ENV: "0.2,1,2,2",
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # The tests under way (both, or the first), while the engine answers: the watch
        # has asked, and waits.
        started = max(workers, 1)
        pid_files = wait_for(
            lambda: len(found := list(tmp_path.glob("*.pid"))) == started and found,
            120,
            what=f"{started} hanging test(s) to start",
        )
        pids = [int(pid) for path in pid_files for pid in path.read_text().split()]
        wait_for(lambda: "/v1.41/networks" in fake_engine.asked, 30, what="the watch to ask")
        assert run.poll() is None, "the watch stopped a run whose engine answers"

        fake_engine.stall()
        output, _ = run.communicate(timeout=60)
    finally:
        run.kill()

    assert run.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "has not answered `GET /networks` 2 times in a row" in output
    assert "moby/moby#46661" in output
    assert "`GET /version` does not answer either" in output
    # The test processes, and the children that ignored SIGTERM: all gone.
    wait_for(lambda: not any(_running(pid) for pid in pids), 30, what="every process to end")


def test_the_watch_finds_the_shared_engine_answering(tmp_path: Path) -> None:
    """The engine the suite runs on answers the watch's ask: it never stops a healthy run."""
    watch = EngineWatch(SOCKET, lambda reason: None, patience=30)
    assert watch.answers()
    assert watch.answers("/version")
