"""`openalice-scheduler serve` and `guard` processes forked from an interpreter that has
already imported the server, instead of each started from nothing.

The suite starts some 350 of them; each spent about 1 s of CPU importing the same modules
(SQLAlchemy, FastAPI, the Docker SDK, our own) before it could answer, a quarter of what
the suite's two cores did. Each is still a process of its own, with its own environment,
working directory, output and exit code, serving real HTTP: only the imports are done once,
by the standard library's fork server (`multiprocessing`'s "forkserver" start method), which
forks each one from an interpreter that imported them when it started and has done nothing
else (no threads, no sockets, no event loop). Its last import (`tests/forkserver_gc.py`)
collects and freezes what the others made, so a child's own collection at start (the
service's `tune_gc`) walks only what the child made: about 0.3 s of CPU a start instead of
0.55 s.

`Forked` answers as much of `subprocess.Popen` as the tests use (`pid`, `poll`, `wait`,
`returncode`, `send_signal`, `kill`); `run_to_end` runs a command to its end, as
`subprocess.run` does (the CLI's tests run most of their commands so: ~0.05 s of CPU each
instead of ~0.8). The entry point itself (the `openalice-scheduler` console script, `python
-m openalice_scheduler`) is still started from nothing where that is the case: the image's
tests, the tests of the console script itself, `scripts/serve-demo`'s."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

# What `serve` and `guard` import on their way to answering (measured with
# `python -X importtime -m openalice_scheduler serve`). A name that fails to import is
# skipped by the fork server, and imported by the child that needs it.
PRELOAD = [
    "openalice_scheduler.cli",
    "openalice_scheduler.startup",
    "openalice_scheduler.app",
    "openalice_scheduler.server",
    "openalice_scheduler.guard",
    "openalice_scheduler.providers",
    "openalice_scheduler.providers.docker",
    # The other backends and the PostgreSQL store: imported by the schedulers configured
    # for them, about 90 of a run (Modal's client alone is ~0.45 s of CPU to import,
    # Kubernetes' ~0.25 s, PostgreSQL's ~0.13 s). None starts a thread or keeps a file or
    # socket open when imported. Modal's client reads its MODAL_ variables when asked,
    # not then (only ~/.modal.toml and MODAL_PROFILE at import: the tests set neither).
    "openalice_scheduler.providers.modal",
    "openalice_scheduler.providers.kubernetes",
    "openalice_scheduler.providers.runpod",
    "openalice_scheduler.providers.static",
    "openalice_scheduler.store.sqlite",
    "openalice_scheduler.store.postgres",
    "uvicorn",
    "uvicorn.protocols.http.h11_impl",
    "uvicorn.protocols.http.httptools_impl",
    "uvicorn.protocols.websockets.wsproto_impl",
    "uvicorn.lifespan.on",
    "uvloop",
    "tests.forkserver_gc",  # last: freezes what the others imported
]

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def _run(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked child: become `python -m openalice_scheduler <argv...>` run in `cwd`
    with exactly `env`, its output appended to `out` and `err` (one file or two)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(file, fd)
        os.close(file)
    # As PYTHONUNBUFFERED does for a process started from nothing: a line is in the file
    # once written, even if the process is killed next.
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    from openalice_scheduler.cli import app

    app(args=argv, prog_name="openalice-scheduler")


class Forked:
    """A forked `openalice-scheduler <command>` (a word, or the whole argument list),
    answering like `subprocess.Popen`."""

    def __init__(
        self, command: str | Sequence[str], env: dict[str, str], cwd: Path, out: Path, err: Path
    ):
        argv = [command] if isinstance(command, str) else list(command)
        self.args = ["openalice-scheduler", *argv]
        # daemon: a test session that ends (or is interrupted) with one still running
        # stops it (SIGTERM) instead of waiting for it.
        self._process = _CONTEXT.Process(
            target=_run, args=(argv, env, str(cwd), str(out), str(err)), daemon=True
        )
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    @property
    def returncode(self) -> int | None:
        """The exit code (minus the signal that ended it), or None while it runs."""
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def run_to_end(
    command: str | Sequence[str], env: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`openalice-scheduler <command>` with exactly `env`, run in `cwd` to its end, what it
    wrote to stdout and to stderr kept apart as text (as `subprocess.run(capture_output=True)`)."""
    with tempfile.TemporaryDirectory(prefix="forked-") as kept:
        out, err = Path(kept) / "out", Path(kept) / "err"
        for path in (out, err):
            path.write_bytes(b"")
        proc = Forked(command, env, cwd, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)
            raise
        texts = [path.read_text(errors="replace") for path in (out, err)]
    return subprocess.CompletedProcess(proc.args, code, stdout=texts[0], stderr=texts[1])
