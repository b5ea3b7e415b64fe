"""The `openalice-scheduler` CLI against the real service, as a script would run it: a
process of its own per command, with SCHEDULER_URL and INTERNAL_SECRET in its environment.

Most commands run forked from the tests' fork server, which has imported the CLI already
(tests/forked.py: each pays ~0.05 s of CPU, not the ~0.8 s of the imports); the console
script installed in the virtualenv, started from nothing, runs where it is what is tested:
its version, its help, and the round trip's acquire."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.forked import run_to_end
from tests.harness import SECRET, Scheduler, flags, free_port, on_static

CLI = Path(sys.executable).parent / "openalice-scheduler"
STATIC_WORKERS = "renderer=http://a:8080,http://b:8080;anim=http://c:9000"
ENV_VALUE = "env-value-" + uuid.uuid4().hex


@pytest.fixture
def static(make_scheduler: Callable[..., Scheduler]) -> Scheduler:
    return on_static(make_scheduler, STATIC_WORKERS, MAX_LEASES_PER_OWNER="1")


def cli(
    url: str, *args: str, secret: str | None = SECRET, script: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run `openalice-scheduler ARGS...` (forked, or the console script from nothing with
    `script`); whatever it does, neither the secret nor a worker env value may appear in
    what it prints."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("INTERNAL_SECRET", "SCHEDULER_URL", "COLUMNS")
    }
    env["SCHEDULER_URL"] = url
    if secret is not None:
        env["INTERNAL_SECRET"] = secret
    if script:
        done = subprocess.run(
            [str(CLI), *args], env=env, capture_output=True, text=True, timeout=120
        )
    else:
        done = run_to_end(args, env, Path.cwd(), timeout=120)
    printed = done.stdout + done.stderr
    assert SECRET not in printed
    assert ENV_VALUE not in printed
    return done


def test_lease_commands_round_trip(static: Scheduler) -> None:
    job = flags(kind="renderer", ttl="600", owner="me", correlation_id="job-1")
    acquired = cli(
        static.url, "lease", "acquire", *job, "--env", f"TOKEN={ENV_VALUE}", "--json", script=True
    )
    assert acquired.returncode == 0, acquired.stderr
    assert acquired.stderr == ""  # the spinner shows on a terminal only
    lease = json.loads(acquired.stdout)
    lease_id = lease["lease_id"]
    assert lease == static.http.get(f"/v1/lease/{lease_id}").json()
    assert (lease["kind"], lease["owner_id"], lease["correlation_id"], lease["state"]) == (
        "renderer",
        "me",
        "job-1",
        "active",
    )

    got = cli(static.url, "lease", "get", lease_id, "--json")
    assert (got.returncode, json.loads(got.stdout)) == (0, lease)
    table = cli(static.url, "lease", "get", lease_id)
    assert table.returncode == 0 and lease_id in table.stdout and lease["endpoint"] in table.stdout

    listed = cli(static.url, "lease", "ls", "--owner", "me", "--kind", "renderer", "--json")
    assert [x["lease_id"] for x in json.loads(listed.stdout)] == [lease_id]
    assert (
        json.loads(
            cli(
                static.url, "lease", "ls", "--state", "released", "--state", "failed", "--json"
            ).stdout
        )
        == []
    )
    rows = cli(static.url, "lease", "ls").stdout.splitlines()
    assert any(row.startswith(lease_id) and "active" in row for row in rows), rows

    renewed = cli(
        static.url, "lease", "renew", lease_id, "--ttl", "1200", "--owner", "me", "--json"
    )
    assert renewed.returncode == 0, renewed.stderr
    assert json.loads(renewed.stdout)["expires_at"] > lease["expires_at"]

    [view] = json.loads(cli(static.url, "providers", "--json").stdout)
    assert (view["name"], view["in_use"]) == ("static", 1)
    assert "static" in cli(static.url, "providers").stdout

    # Without --owner the service refuses; with it the lease ends.
    assert cli(static.url, "lease", "release", lease_id).returncode == 4
    released = cli(static.url, "lease", "release", lease_id, "--owner", "me", "--json")
    assert (released.returncode, json.loads(released.stdout)) == (
        0,
        {"lease_id": lease_id, "released": True},
    )
    assert (
        json.loads(cli(static.url, "lease", "get", lease_id, "--json").stdout)["state"]
        == "released"
    )
    assert cli(static.url, "lease", "ls").stdout.strip() == "No leases."


def test_exit_codes(static: Scheduler) -> None:
    missing = cli(static.url, "lease", "get", str(uuid.uuid4()))
    assert missing.returncode == 3 and "lease_not_found" in missing.stderr
    assert missing.stdout == ""
    # An empty id (`$id` of a failed acquire in a script) is a usage error, never sent.
    for command in (["get", ""], ["renew", ""], ["release", ""]):
        empty = cli(static.url, "lease", *command)
        assert empty.returncode == 2, (command, empty.stderr)
        assert "lease_id: must not be empty" in empty.stderr

    wrong = cli(static.url, "lease", "ls", secret="wrong-secret")
    assert wrong.returncode == 4 and "unauthorized" in wrong.stderr
    unset = cli(static.url, "lease", "ls", secret=None)
    assert unset.returncode == 2 and "INTERNAL_SECRET" in unset.stderr

    assert cli(static.url, "lease", "acquire", "--kind", "renderer", "--ttl", "0").returncode == 2
    bad_env = cli(static.url, "lease", "acquire", "--kind", "renderer", "--env", ENV_VALUE)
    assert bad_env.returncode == 2 and "KEY=VALUE" in bad_env.stderr
    bad_key = cli(
        static.url, "lease", "acquire", "--kind", "renderer", "--env", f"bad-key={ENV_VALUE}"
    )
    assert bad_key.returncode == 2 and "bad-key" in bad_key.stderr
    assert cli(static.url, "lease", "acquire", "--kind", "painter").returncode == 2

    assert cli(static.url, "lease", "acquire", "--kind", "anim").returncode == 0
    full = cli(static.url, "lease", "acquire", "--kind", "anim", "--json")
    assert full.returncode == 5 and full.stdout == ""
    error = json.loads(full.stderr)
    assert (error["error"], error["status"]) == ("no_provider_available", 503)
    assert 1 <= error["retry_after"] <= 300

    assert cli(static.url, "lease", "acquire", "--kind", "renderer", "--owner", "o").returncode == 0
    quota = cli(static.url, "lease", "acquire", "--kind", "renderer", "--owner", "o")
    assert quota.returncode == 7 and "quota_exceeded" in quota.stderr

    nowhere = cli(f"http://127.0.0.1:{free_port()}", "providers")
    assert nowhere.returncode == 5 and "cannot reach" in nowhere.stderr


def test_provision_failure_exits_6(make_scheduler: Callable[..., Scheduler]) -> None:
    sched = make_scheduler(PROVIDERS="local-docker", RENDERER_IMAGE="openalice-missing:never")
    failed = cli(sched.url, "lease", "acquire", "--kind", "renderer")
    assert failed.returncode == 6
    assert "provision_failed" in failed.stderr and "openalice-missing:never" in failed.stderr


def test_help_documents_the_exit_codes() -> None:
    for args in (
        ["lease", "--help"],
        ["lease", "acquire", "--help"],
        ["providers", "--help"],
        ["usage", "--help"],
    ):
        shown = cli("http://127.0.0.1:1", *args, script=True)
        assert shown.returncode == 0
        text = " ".join(shown.stdout.split())
        for code in (
            "0 ok",
            "1 other error",
            "2 usage",
            "3 lease not found",
            "4 unauthorized or forbidden",
            "5 no capacity",
            "6 provision failed",
            "7 owner quota",
        ):
            assert code in text, (args, code)


def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    shown = cli("http://127.0.0.1:1", "--version", script=True)
    assert shown.returncode == 0
    assert shown.stdout.strip() == f"openalice-scheduler {version('openalice-scheduler')}"


def test_tune_gc_freezes_what_exists_and_widens_the_first_generation() -> None:
    """`serve` calls tune_gc once the app is built (in its own process here: freezing
    would stay in the test process)."""
    code = (
        "import gc\n"
        "import openalice_scheduler.app  # what serve has imported by then\n"
        "from openalice_scheduler.server import GC_YOUNG_THRESHOLD, tune_gc\n"
        "tracked = len(gc.get_objects())\n"
        "tune_gc()\n"
        "print(tracked, gc.get_freeze_count(), len(gc.get_objects()),\n"
        "      gc.get_threshold()[0] == GC_YOUNG_THRESHOLD)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    tracked, frozen, left, widened = done.stdout.split()
    # Everything the imports made is out of the generations a collection walks.
    assert int(frozen) >= 0.9 * int(tracked) > 10_000
    assert int(left) < int(tracked) / 10
    assert widened == "True"


def test_output_formats(static: Scheduler) -> None:
    job = flags(kind="renderer", owner="me", correlation_id="job-42")
    acquired = cli(static.url, "lease", "acquire", *job, "-o", "json")
    assert acquired.returncode == 0, acquired.stderr
    lease = json.loads(acquired.stdout)
    lease_id = lease["lease_id"]
    # -o json is what --json prints.
    for command in (["lease", "get", lease_id], ["lease", "ls"], ["providers"]):
        assert (
            cli(static.url, *command, "-o", "json").stdout
            == cli(static.url, *command, "--json").stdout
        ), command

    def header_and_row(*args: str) -> tuple[list[str], str]:
        done = cli(static.url, "lease", "ls", *args)
        assert done.returncode == 0, done.stderr
        header, *rows = done.stdout.splitlines()
        [row] = [r for r in rows if r.startswith(lease_id)]
        return header.split("  "), row

    table_header, table_row = header_and_row()
    assert "CORRELATION ID" not in " ".join(table_header) and "job-42" not in table_row
    wide_header, wide_row = header_and_row("-o", "wide")
    names = [n.strip() for n in wide_header if n.strip()]
    assert names == [
        "LEASE ID",
        "STATE",
        "KIND",
        "GPU",
        "CREATED (UTC)",
        "EXPIRES (UTC)",
        "PROVIDER",
        "PROVIDER TOKEN",
        "OWNER",
        "CLASS",
        "PREEMPT AT (UTC)",
        "CORRELATION ID",
        "REGION",
        "REASON",
        "ENDPOINT",
    ]
    for value in (
        "job-42",
        lease["provider_token"],
        lease["endpoint"],
        lease["created_at"][:19].replace("T", " "),
    ):
        assert value in wide_row, (value, wide_row)

    # One lease's table already shows every field: wide is the same.
    one = cli(static.url, "lease", "get", lease_id, "-o", "wide")
    assert one.returncode == 0 and "job-42" in one.stdout
    assert one.stdout == cli(static.url, "lease", "get", lease_id).stdout

    table = cli(static.url, "providers").stdout
    wide = cli(static.url, "providers", "-o", "wide").stdout
    assert "BY KIND" not in table and "BY KIND" in wide
    assert "renderer none 1/2" in wide and "anim none 0/1" in wide

    renewed = cli(static.url, "lease", "renew", lease_id, "--owner", "me", "-o", "json")
    assert json.loads(renewed.stdout)["lease_id"] == lease_id
    missing = cli(static.url, "lease", "get", str(uuid.uuid4()), "-o", "json")
    assert missing.returncode == 3 and json.loads(missing.stderr)["error"] == "lease_not_found"
    released = cli(static.url, "lease", "release", lease_id, "--owner", "me", "-o", "json")
    assert json.loads(released.stdout) == {"lease_id": lease_id, "released": True}

    disagree = cli(static.url, "lease", "ls", "--json", "-o", "table")
    assert disagree.returncode == 2 and "disagree" in disagree.stderr
    assert cli(static.url, "lease", "ls", "-o", "yaml").returncode == 2


def test_an_idempotent_acquire_is_retried(make_scheduler: Callable[..., Scheduler]) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    pair = ("--owner", "o", "--correlation-id", "c", "--retry-timeout", "1")
    noted = cli(nowhere, "lease", "acquire", "--kind", "renderer", *pair)
    assert noted.returncode == 5
    assert "attempt 2 of at most" in noted.stderr and "cannot reach" in noted.stderr
    quiet = cli(nowhere, "lease", "acquire", "--kind", "renderer", *pair, "-o", "json")
    assert quiet.returncode == 5
    assert json.loads(quiet.stderr)["error"] == "scheduler_unreachable"  # that line alone
    once = cli(nowhere, "lease", "acquire", "--kind", "renderer", "--owner", "o")
    assert once.returncode == 5 and "attempt 2" not in once.stderr

    # A scheduler that comes up a second after the command started serves it.
    sched = make_scheduler(start=False, PROVIDERS="static", STATIC_WORKERS=STATIC_WORKERS)
    starter = threading.Timer(1.0, sched.start, kwargs={"wait": False})
    starter.start()
    try:
        job = flags(kind="anim", owner="o", correlation_id="late", retry_timeout="120")
        late = cli(sched.url, "lease", "acquire", *job, "-o", "json")
    finally:
        starter.join()
    assert late.returncode == 0, late.stderr
    lease = json.loads(late.stdout)
    assert [x["lease_id"] for x in sched.leases()] == [lease["lease_id"]]
