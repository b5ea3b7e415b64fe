"""Tracing to a real OTLP/gRPC receiver, and logs that honour the filter and keep secrets."""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from pathlib import Path

import pytest

from openalice_scheduler.config import Settings
from openalice_scheduler.logs import configure_logging
from tests.harness import HTTP, SECRET, free_port, printed_lines, run_serve, wait_for
from tests.otlp_receiver import OtlpReceiver

RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")


def test_spans_reach_a_real_otlp_receiver(make_scheduler) -> None:  # type: ignore[no-untyped-def]
    receiver = OtlpReceiver()
    endpoint = receiver.start()
    try:
        env_secret = "env-value-" + uuid.uuid4().hex
        sched = make_scheduler(
            OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
            OTEL_SERVICE_NAME="scheduler-under-test",
            SWEEP_INTERVAL_SECONDS="1",
        )
        lease = sched.lease(
            kind="anim", correlation_id="corr-42", env={"TOKEN": env_secret}, ttl_seconds=1
        )
        expired_at = time.time()
        wait_for(lambda: receiver.named("release"), 30, what="release span")
        provision = wait_for(lambda: receiver.named("provision"), 30, what="provision span")[0]
        assert provision.attributes["lease_id"] == lease["lease_id"]
        assert provision.attributes["provider"] == "local-docker"
        assert provision.attributes["kind"] == "anim"
        assert provision.attributes["correlation_id"] == "corr-42"
        assert provision.resource["service.name"] == "scheduler-under-test"
        assert provision.resource["service.version"]

        # Each span is exported when it ends, batch by batch: wait for the request's.
        request = wait_for(
            lambda: [
                s for s in receiver.named("POST /v1/lease") if s.trace_id == provision.trace_id
            ],
            30,
            what="the request span",
        )
        assert provision.parent_span_id == request[0].span_id
        assert request[0].attributes["http.response.status_code"] == 200

        release = receiver.named("release")[0]
        assert release.attributes["lease_id"] == lease["lease_id"]
        sweep = wait_for(
            lambda: [s for s in receiver.named("sweep") if s.trace_id == release.trace_id],
            30,
            what="the sweep span",
        )
        assert release.parent_span_id == sweep[0].span_id
        assert time.time() - expired_at < 60

        # Nothing secret in any exported byte.
        blob = b"".join(receiver.raw_requests)
        assert env_secret.encode() not in blob
        assert SECRET.encode() not in blob
    finally:
        receiver.stop()


def test_unreachable_collector_never_breaks_a_request(make_scheduler) -> None:  # type: ignore[no-untyped-def]
    # Nothing listens on port 9 (discard) on loopback here.
    sched = make_scheduler(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9")
    for _ in range(3):
        lease = sched.lease(kind="renderer")
        assert sched.release(lease["lease_id"]).status_code == 204
    assert HTTP.get(f"{sched.url}/health").status_code == 200


def test_logs_never_show_secrets_or_env_values(make_scheduler) -> None:  # type: ignore[no-untyped-def]
    env_secret = "env-value-" + uuid.uuid4().hex
    sched = make_scheduler(RUST_LOG="trace")
    lease = sched.lease(kind="renderer", correlation_id="corr-log", env={"PASSWORD": env_secret})
    sched.http.post("/v1/lease", json={"kind": "renderer", "env": {"BAD-KEY": env_secret}})
    HTTP.get(f"{sched.url}/v1/leases", headers={"X-Internal-Secret": "wrong-" + SECRET})
    sched.release(lease["lease_id"])
    sched.stop()
    log = sched.log()
    assert lease["lease_id"] in log and "corr-log" in log  # the log is really there
    assert "DEBUG" in log
    assert env_secret not in log
    assert SECRET not in log


def test_log_filter_is_honoured(make_scheduler) -> None:  # type: ignore[no-untyped-def]
    quiet = make_scheduler(RUST_LOG="warn")
    lease = quiet.lease(kind="renderer")
    quiet.release(lease["lease_id"])
    quiet.stop()
    assert lease["lease_id"] not in quiet.log()
    assert " INFO " not in quiet.log()

    targeted = make_scheduler(RUST_LOG="error,openalice_scheduler=info", LOG_LEVEL="")
    lease = targeted.lease(kind="renderer")
    targeted.stop()
    log = targeted.log()
    assert f"lease {lease['lease_id']} acquired" in log
    assert "uvicorn" not in log  # uvicorn's info lines are filtered out at `error`


def test_a_short_internal_secret_stops_start_up(tmp_path: Path) -> None:
    base = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "SCHEDULER_HOST": "127.0.0.1",
        "SCHEDULER_PORT": str(free_port()),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'short.db'}",
        "LOCAL_GPU_DEVICES": "",
        # Touches no Docker engine, should it start after all.
        "PROVIDERS": "static",
        "STATIC_WORKERS": "renderer=http://only:8080",
        "SCHEDULER_INSTANCE": f"t-short-{uuid.uuid4().hex[:8]}",
    }
    for secret in ("x", "s" * 15):
        done = run_serve({**base, "INTERNAL_SECRET": secret}, tmp_path, timeout=30)
        lines = printed_lines(done.stderr)
        assert done.returncode != 0, done.stderr
        assert lines == [
            "openalice-scheduler: invalid configuration: INTERNAL_SECRET: must be at least "
            f"16 characters, got "
            f"{len(secret)} (e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))')"
        ], done.stderr
    # Sixteen is enough.
    assert Settings(internal_secret="s" * 16).internal_secret.get_secret_value() == "s" * 16


def test_tracebacks_and_the_database_password_are_redacted(
    real_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    password, query_password = "pw-" + uuid.uuid4().hex, "qpw-" + uuid.uuid4().hex
    settings = Settings(  # type: ignore[call-arg]
        internal_secret=SECRET,
        database_url=f"postgresql://sched:{password}@db.invalid/leases"
        f"?sslpassword={query_password}",
    )
    configure_logging("info", settings.secrets())
    log = logging.getLogger("openalice_scheduler.test")
    try:
        raise ConnectionError(f"store at {settings.database_url} refused {SECRET}")
    except ConnectionError:
        log.exception("state store unavailable")
    log.warning("retrying with %s", password)
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ConnectionError: store at" in err
    assert "[redacted]" in err
    for secret in (SECRET, password, query_password):
        assert secret not in err


def test_no_record_can_forge_a_log_line(
    real_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info")
    log = logging.getLogger("openalice_scheduler.service")
    forged = "2026-01-01 00:00:00,000 INFO openalice_scheduler.service: lease x released"
    log.info("lease %s acquired (correlation_id=%s)", "l-1", f"job\n{forged}")
    log.info("two\rlines\u2028and an escape \x1b[2J")
    try:
        raise ValueError(f"bad input\n{forged}")
    except ValueError:
        log.exception("failed")
    lines = capsys.readouterr().err.splitlines()
    records = [line for line in lines if RECORD_START.match(line)]
    assert len(records) == 3, lines
    assert records[0].endswith("lease l-1 acquired (correlation_id=job\\n" + forged + ")")
    assert records[1].endswith("two\\rlines\\u2028and an escape \\x1b[2J")
    # The traceback follows its record, every line of it indented.
    assert lines[-1].strip() == forged and lines[-1].startswith(" ")
    assert all(line.startswith(" ") for line in lines if not RECORD_START.match(line))
