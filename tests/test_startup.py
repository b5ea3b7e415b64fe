"""Start-up that explains itself: every invalid variable reported at once, misspelt
settings warned about, PostgreSQL waited for while it cannot be reached. Real service
processes (`python -m openalice_scheduler serve`), the real PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.engine import make_url

from tests.harness import (
    PG_HOST,
    Scheduler,
    database_url,
    free_port,
    printed_lines,
    run_serve,
    wait_for,
)

STATIC = {"PROVIDERS": "static", "STATIC_WORKERS": "renderer=http://worker-a:8080"}


def serve(
    tmp_path: Path, env: dict[str, str], timeout: float = 90
) -> subprocess.CompletedProcess[str]:
    """`serve` with exactly `env` (plus what Python needs), run to its end."""
    full = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "PYTHONUNBUFFERED": "1",
        "SCHEDULER_HOST": "127.0.0.1",
        "SCHEDULER_PORT": str(free_port()),
        "SCHEDULER_INSTANCE": f"t-st-{uuid.uuid4().hex[:8]}",
        **env,
    }
    return run_serve(full, tmp_path, timeout)


# --- every invalid variable at once ----------------------------------------------------


def test_every_invalid_variable_is_reported_at_once_without_its_value(tmp_path: Path) -> None:
    secret = "tiny-" + uuid.uuid4().hex[:8]  # too short, and must not be printed
    runpod_key = "rpk-" + uuid.uuid4().hex
    password = "pw-" + uuid.uuid4().hex
    env = {
        "INTERNAL_SECRET": secret,
        "SCHEDULER_PORT": "eighty",
        "DATABASE_URL": f"postgresql://sched:{password}@db:notaport/leases",
        "LOCAL_GPU_DEVICES": "0;1",
        "DOCKER_HOST": "docker.internal:2375",
        "RUNPOD_API": "soap",
        "RUNPOD_API_KEY": runpod_key,
        # Checked by the providers' configuration, reported with the settings' errors.
        "PROVIDERS": "static,runpod,bogus",
        "STATIC_WORKERS": "renderer=ftp://worker-a",
    }
    result = serve(tmp_path, env)

    assert result.returncode == 2, result.stderr
    lines = printed_lines(result.stderr)
    prefix = "openalice-scheduler: invalid configuration: "
    assert all(line.startswith(prefix) for line in lines), lines
    by_variable = {line.removeprefix(prefix).split(":")[0]: line for line in lines}
    assert len(by_variable) == len(lines), lines  # one line each
    assert set(by_variable) == {
        "INTERNAL_SECRET",
        "SCHEDULER_PORT",
        "DATABASE_URL",
        "LOCAL_GPU_DEVICES",
        "DOCKER_HOST",
        "RUNPOD_API",
        "PROVIDERS",
        "STATIC_WORKERS",
    }, lines
    assert "'bogus'" in by_variable["PROVIDERS"], lines
    assert "'ftp://worker-a' is not an http(s) URL" in by_variable["STATIC_WORKERS"], lines
    assert "Traceback" not in result.stderr and result.stdout == ""
    for value in (secret, runpod_key, password):
        assert value not in result.stderr
    assert list(tmp_path.iterdir()) == [], "nothing is created by a refused start"


def test_a_lone_runpod_without_a_key_is_reported_with_the_other_errors(tmp_path: Path) -> None:
    result = serve(
        tmp_path,
        {"INTERNAL_SECRET": "s" * 32, "PROVIDERS": "runpod", "SWEEP_INTERVAL_SECONDS": "0"},
    )
    assert result.returncode == 2, result.stderr
    assert [line.split(": ")[2] for line in printed_lines(result.stderr)] == [
        "SWEEP_INTERVAL_SECONDS",
        "PROVIDERS",
    ], result.stderr
    assert "RUNPOD_API_KEY is not set" in result.stderr


# --- misspelt settings ---------------------------------------------------------------


def test_a_misspelt_setting_is_warned_about_and_the_service_serves(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    unrelated = {
        "DOCKER_CONFIG": "/nonexistent",  # the Docker CLI's own
        "OTEL_RESOURCE_ATTRIBUTES": "team=render",  # OpenTelemetry's own
        "SCHEDULER_URL": "http://127.0.0.1:1",  # the client's own
        # Kubernetes' service links, for a Service named scheduler-db.
        "SCHEDULER_DB_SERVICE_HOST": "10.0.0.7",
        "SCHEDULER_DB_PORT": "tcp://10.0.0.7:5432",
        "LANG": "C.UTF-8",
    }
    sched = make_scheduler(SCHEDULER_PROT="9999", RUNPOD_TEMPLATE="tpl", **STATIC, **unrelated)
    lease = sched.lease()
    assert lease["provider"] == "static"

    warnings = [line for line in sched.log().splitlines() if "is not a setting" in line]
    assert any(
        " WARNING " in line
        and line.endswith("SCHEDULER_PROT is not a setting; did you mean SCHEDULER_PORT?")
        for line in warnings
    ), warnings
    assert any("RUNPOD_TEMPLATE is not a setting" in line for line in warnings), warnings
    for name in unrelated:
        assert not any(name in line for line in warnings), warnings


def test_a_misspelling_is_shown_beside_the_error_it_explains(tmp_path: Path) -> None:
    result = serve(tmp_path, {"INTERNAL_SECRT": "s" * 32, **STATIC})
    assert result.returncode == 2, result.stderr
    assert printed_lines(result.stderr) == [
        "openalice-scheduler: invalid configuration: INTERNAL_SECRET: is required but not set",
        "openalice-scheduler: warning: INTERNAL_SECRT is not a setting; did you mean "
        "INTERNAL_SECRET?",
    ]
    assert "s" * 32 not in result.stderr


# --- the database at start-up --------------------------------------------------------


def test_an_unreachable_postgresql_is_retried_then_named_in_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    password = "pw-" + uuid.uuid4().hex
    started = time.monotonic()
    result = serve(
        tmp_path,
        {
            "INTERNAL_SECRET": "s" * 32,
            **STATIC,
            "STARTUP_TIMEOUT_SECONDS": "3",
            "DATABASE_URL": f"postgresql://sched:{password}@127.0.0.1:{port}/leases",
        },
    )
    took = time.monotonic() - started

    assert result.returncode == 2, result.stderr
    lines = printed_lines(result.stderr)
    retries = [line for line in lines if "retrying" in line]
    assert retries and all(f"127.0.0.1:{port} unreachable" in line for line in retries), lines
    assert lines[-1].startswith(
        f"openalice-scheduler: DATABASE_URL: PostgreSQL at 127.0.0.1:{port} still "
        "unreachable after 3 s (connection refused)"
    ), lines
    assert len(lines) == len(retries) + 1, lines
    assert "Traceback" not in result.stderr and password not in result.stderr + result.stdout
    assert took < 60, took  # it gave up, after about STARTUP_TIMEOUT_SECONDS


def test_a_missing_postgresql_database_fails_at_once_without_retrying(tmp_path: Path) -> None:
    missing = f"oa_missing_{uuid.uuid4().hex[:8]}"
    result = serve(
        tmp_path,
        {
            "INTERNAL_SECRET": "s" * 32,
            **STATIC,
            "STARTUP_TIMEOUT_SECONDS": "600",
            "DATABASE_URL": f"postgresql://{getpass.getuser()}@/{missing}?host={PG_HOST}",
        },
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert printed_lines(result.stderr) == [
        f"openalice-scheduler: DATABASE_URL: cannot connect to PostgreSQL at {PG_HOST}:5432: "
        f'database "{missing}" does not exist'
    ], result.stderr


def test_postgresql_that_comes_up_during_the_wait_is_used(
    make_scheduler: Callable[..., Scheduler],
    tmp_path: Path,
) -> None:
    with database_url("postgresql", tmp_path) as real, LatePostgres() as late:
        name = make_url(real).database
        sched = make_scheduler(
            start=False,
            **STATIC,
            DATABASE_URL=f"postgresql://{getpass.getuser()}@127.0.0.1:{late.port}/{name}",
        )
        sched.start(wait=False)
        wait_for(lambda: "retrying" in sched.log(), 60, what="a retry logged")
        late.open()
        sched.wait_ready(timeout=90)

        lease = sched.lease()
        assert [found["lease_id"] for found in sched.leases()] == [lease["lease_id"]]
        assert f"PostgreSQL at 127.0.0.1:{late.port} unreachable" in sched.log()
        assert "Traceback" not in sched.log()
        sched.stop()


def test_a_sqlite_path_that_cannot_be_opened_stops_start_up_in_one_line(
    tmp_path: Path,
) -> None:
    (tmp_path / "plain-file").write_text("not a directory")
    (tmp_path / "a-directory").mkdir()
    (tmp_path / "garbage.db").write_text("not a database, but long enough to have a header")
    cases = {
        tmp_path / "plain-file" / "state.db": "Not a directory",
        tmp_path / "a-directory": "unable to open database file",
        tmp_path / "garbage.db": "file is not a database",
    }
    for path, reason in cases.items():
        result = serve(
            tmp_path, {"INTERNAL_SECRET": "s" * 32, **STATIC, "DATABASE_URL": f"sqlite:///{path}"}
        )
        assert result.returncode == 2, (path, result.stderr)
        lines = printed_lines(result.stderr)
        assert len(lines) == 1, (path, lines)
        assert lines[0].startswith(
            f"openalice-scheduler: DATABASE_URL: cannot open the SQLite database {path}: "
        ), lines
        assert reason in lines[0], (reason, lines)


class LatePostgres:
    """A TCP port on 127.0.0.1 that refuses connections until `open()`, then forwards
    each one to the real PostgreSQL's socket: a database that starts after the
    scheduler, as in a compose file."""

    def __init__(self) -> None:
        self.port = free_port()
        self.socket = f"{PG_HOST}/.s.PGSQL.5432"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: asyncio.Server | None = None

    def __enter__(self) -> LatePostgres:
        self.thread.start()
        return self

    def open(self) -> None:
        async def start() -> asyncio.Server:
            return await asyncio.start_server(self._forward, "127.0.0.1", self.port)

        self.server = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self.server is not None:
                self.server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    async def _forward(
        self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter
    ) -> None:
        server_r, server_w = await asyncio.open_unix_connection(self.socket)

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))
