"""The test session's watch on the Docker engine (tests/enginewatch.py): a run whose engine
stops answering `GET /networks` (Docker 20.10's deadlock, moby/moby#46661) ends within
seconds of its times, saying why, with nothing it started left running; a run whose
engine answers is left alone. The engine is the real one, behind the suite's fault proxy
(dockerproxy.py), which holds the calls a deadlocked engine would never answer."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dockerproxy import DockerProxy
from tests.enginewatch import (
    SOCKET,
    SOCKET_ENV,
    TIMES_ENV,
    EngineWatch,
    stop_everything_below,
)
from tests.harness import REPO, wait_for
from tests.procs import running

NETWORKS = "GET /v1.41/networks"


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[DockerProxy]:
    with DockerProxy(tmp_path / "engine.sock") as proxy:
        yield proxy


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


@pytest.mark.parametrize("workers", [2, 0])
def test_a_run_whose_engine_stops_answering_ends_saying_why_and_leaves_nothing_running(
    tmp_path: Path, engine: DockerProxy, workers: int
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
            SOCKET_ENV: engine.path,
            # every 0.2 s; 5 s of patience (a loaded engine answers in less); two misses;
            # 2 s of grace before SIGKILL
            TIMES_ENV: "0.2,5,2,2",
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
        wait_for(lambda: NETWORKS in engine.seen, 30, what="the watch to ask")
        assert run.poll() is None, "the watch stopped a run whose engine answers"

        # As the deadlock: network calls never answered, the rest (`docker ps`) answered.
        engine.delay(f"^{NETWORKS}", 3600)
        output, _ = run.communicate(timeout=60)
    finally:
        if run.poll() is None:  # the watch did not end it: nothing of it outlives the test
            stop_everything_below(run.pid, grace=5)
            run.kill()
            run.wait()

    assert run.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "has not answered `GET /networks` 2 times in a row" in output
    assert "moby/moby#46661" in output
    assert "`GET /version` still answers (as `docker ps` does)" in output
    # The test processes, and the children that ignored SIGTERM: all gone.
    wait_for(lambda: not any(running(pid) for pid in pids), 30, what="every process to end")


def test_the_watch_finds_the_shared_engine_answering(tmp_path: Path) -> None:
    """The engine the suite runs on answers the watch's ask: it never stops a healthy run."""
    watch = EngineWatch(SOCKET, lambda reason: None, patience=30)
    assert watch.answers()
    assert watch.answers("/version")
