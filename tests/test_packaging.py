"""What a caller installs: `pip install openalice-scheduler` brings the client and the CLI's
client commands, and none of the server's dependencies, which are the `[server]` extra.

The metadata is read as pip reads it (`importlib.metadata`), and pyproject.toml too (the
tree under test, should the installed metadata be older). The client and the console
script then run in a process where the server's packages cannot be imported (a
`sys.meta_path` finder refuses them, as if they were not installed) against a real
scheduler: a lease acquired and released, `--help`, shell completion in a real bash."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Callable
from importlib.metadata import requires
from pathlib import Path

import pytest

from tests.harness import REPO, SECRET, Scheduler, flags

# Import names, and the distributions that provide them.
SERVER_MODULES = (
    "fastapi",
    "sqlalchemy",
    "asyncpg",
    "docker",
    "grpc",
    "starlette",
    "uvicorn",
    "pydantic_settings",
    "prometheus_client",
    "opentelemetry",
    "alembic",
    "uvloop",
    "httptools",
)
SERVER_DISTS = {
    "fastapi",
    "sqlalchemy",
    "asyncpg",
    "docker",
    "grpcio",
    "starlette",
    "uvicorn",
    "pydantic-settings",
    "prometheus-client",
    "alembic",
    "uvloop",
    "httptools",
}
STATIC_WORKERS = "renderer=http://a:8080;anim=http://c:9000"

# Run first in the child: refuse the server's packages, then run the rest.
REFUSE = textwrap.dedent(f"""
    import importlib.abc, sys
    SERVER = {SERVER_MODULES!r}

    class RefuseServer(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in SERVER:
                raise ModuleNotFoundError(f"No module named {{name!r}} (refused)", name=name)
            return None

    already = [m for m in sys.modules if m.partition(".")[0] in SERVER]
    assert not already, already
    sys.meta_path.insert(0, RefuseServer())
""")
CONSOLE = REFUSE + textwrap.dedent("""
    sys.argv[0] = "openalice-scheduler"
    from openalice_scheduler.cli import main
    main()
""")


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_base_requirements_name_no_server_package() -> None:
    installed = requires("openalice-scheduler") or []
    base = {_name(r) for r in installed if "extra ==" not in r}
    server = {_name(r) for r in installed if re.search(r"extra\s*==\s*['\"]server['\"]", r)}
    assert base >= {"httpx", "pydantic", "typer", "rich"}
    assert base.isdisjoint(SERVER_DISTS), base & SERVER_DISTS
    assert {"fastapi", "uvicorn", "sqlalchemy", "asyncpg", "docker"} <= server

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {_name(r) for r in project["dependencies"]}
    assert declared.isdisjoint(SERVER_DISTS), declared & SERVER_DISTS
    # Ranges in the metadata, exact pins in the lock, for every requirement of both.
    pinned = {
        _name(line.split("==")[0])
        for line in (REPO / "requirements.lock").read_text().splitlines()
        if "==" in line
    }
    for requirement in [*project["dependencies"], *project["optional-dependencies"]["server"]]:
        assert not re.search(r"==", requirement), requirement
        assert _name(requirement) in pinned, requirement


@pytest.fixture
def static(make_scheduler: Callable[..., Scheduler]) -> Scheduler:
    return make_scheduler(PROVIDERS="static", STATIC_WORKERS=STATIC_WORKERS)


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("INTERNAL_SECRET", "SCHEDULER_URL", "COLUMNS")
    }
    return {**env, **extra}


def test_the_client_runs_without_the_server(static: Scheduler) -> None:
    code = REFUSE + textwrap.dedent("""
        import json, os
        from openalice_scheduler import errors, models
        from openalice_scheduler.client import SchedulerClient
        from openalice_scheduler.errors import LeaseNotFound

        with SchedulerClient(os.environ["URL"], os.environ["SECRET"]) as client:
            with client.lease("renderer", ttl_seconds=60, owner_id="anim") as held:
                endpoint = held.endpoint
            try:
                client.renew(held.lease_id)
            except LeaseNotFound:
                ended = True
            state = client.get(held.lease_id).state
        print(json.dumps({"endpoint": endpoint, "state": state, "ended": ended}))
    """)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(URL=static.url, SECRET=SECRET),
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "endpoint": "http://a:8080",
        "state": "released",
        "ended": True,
    }


@pytest.fixture
def console(tmp_path: Path) -> Path:
    """An `openalice-scheduler` on PATH that runs the console script with the server's
    packages refused."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "openalice-scheduler"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} -c "$OA_CONSOLE" "$@"\n')
    script.chmod(0o755)
    return bin_dir


def run_console(bin_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["openalice-scheduler", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", OA_CONSOLE=CONSOLE, **env),
    )


def test_the_cli_runs_without_the_server(static: Scheduler, console: Path) -> None:
    helped = run_console(console, "lease", "--help")
    assert helped.returncode == 0 and "acquire" in helped.stdout, helped.stderr
    assert run_console(console, "--version").stdout.startswith("openalice-scheduler ")

    on_service = {"SCHEDULER_URL": static.url, "INTERNAL_SECRET": SECRET}
    job = flags(kind="anim", owner="me", correlation_id="job-1")
    acquired = run_console(console, "lease", "acquire", *job, "-o", "json", **on_service)
    assert acquired.returncode == 0, acquired.stderr
    lease = json.loads(acquired.stdout)
    assert (lease["endpoint"], lease["state"]) == ("http://c:9000", "active")
    listed = run_console(console, "lease", "ls", "-o", "wide", **on_service)
    assert listed.returncode == 0 and "job-1" in listed.stdout, listed.stderr
    released = run_console(
        console, "lease", "release", lease["lease_id"], "--owner", "me", **on_service
    )
    assert released.returncode == 0, released.stderr
    assert static.http.get(f"/v1/lease/{lease['lease_id']}").json()["state"] == "released"

    # `serve` says what to install instead of a traceback.
    served = run_console(console, "serve", INTERNAL_SECRET=SECRET)
    assert served.returncode == 2
    assert "pip install 'openalice-scheduler[server]'" in served.stderr
    assert "Traceback" not in served.stderr


def test_shell_completion_without_the_server(console: Path) -> None:
    bash = shutil.which("bash")
    assert bash, "bash is needed to try the completion script"
    script = run_console(console, _OPENALICE_SCHEDULER_COMPLETE="source_bash")
    assert script.returncode == 0 and "complete " in script.stdout, script.stderr
    # --show-completion prints the script of the shell it runs under (found from its
    # parent processes): here bash's, the same script.
    shown = subprocess.run(
        [bash, "--norc", "--noprofile", "-c", "openalice-scheduler --show-completion; exit $?"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_clean_env(PATH=f"{console}:{os.environ['PATH']}", OA_CONSOLE=CONSOLE),
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == script.stdout.strip()

    def completions(line: str) -> list[str]:
        # What bash offers on <Tab>, through the script the CLI printed.
        probe = (
            f"{script.stdout}\nCOMP_WORDS=({line}); COMP_CWORD=$((${{#COMP_WORDS[@]}}"
            f"{'' if line.endswith(' ') else ' - 1'}))\n"
            "_openalice_scheduler_completion openalice-scheduler\n"
            'printf "%s\\n" "${COMPREPLY[@]}"\n'
        )
        done = subprocess.run(
            [bash, "--norc", "--noprofile", "-c", probe],
            capture_output=True,
            text=True,
            timeout=120,
            env=_clean_env(PATH=f"{console}:{os.environ['PATH']}", OA_CONSOLE=CONSOLE),
        )
        assert done.returncode == 0, done.stderr
        return [line.split(":")[0] for line in done.stdout.splitlines() if line]

    assert completions("openalice-scheduler lease ac") == ["acquire"]
    assert completions("openalice-scheduler lease acquire --kind ") == ["renderer", "anim"]
    assert completions("openalice-scheduler lease ls -o ") == ["table", "wide", "json"]
