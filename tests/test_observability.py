"""Tracing to a real OTLP/gRPC receiver, and logs that honour the filter and keep secrets."""

from __future__ import annotations

import time
import uuid

import httpx

from tests.harness import SECRET, wait_for
from tests.otlp_receiver import OtlpReceiver


def test_spans_reach_a_real_otlp_receiver(make_scheduler) -> None:  # type: ignore[no-untyped-def]
    receiver = OtlpReceiver()
    endpoint = receiver.start()
    try:
        env_secret = "env-value-" + uuid.uuid4().hex
        sched = make_scheduler(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                               OTEL_SERVICE_NAME="scheduler-under-test",
                               SWEEP_INTERVAL_SECONDS="1")
        lease = sched.lease(kind="anim", correlation_id="corr-42",
                            env={"TOKEN": env_secret}, ttl_seconds=1)
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
        request = wait_for(lambda: [s for s in receiver.named("POST /v1/lease")
                                    if s.trace_id == provision.trace_id], 30,
                           what="the request span")
        assert provision.parent_span_id == request[0].span_id
        assert request[0].attributes["http.response.status_code"] == 200

        release = receiver.named("release")[0]
        assert release.attributes["lease_id"] == lease["lease_id"]
        sweep = wait_for(lambda: [s for s in receiver.named("sweep")
                                  if s.trace_id == release.trace_id], 30, what="the sweep span")
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
    assert httpx.get(f"{sched.url}/health").status_code == 200


def test_logs_never_show_secrets_or_env_values(make_scheduler) -> None:  # type: ignore[no-untyped-def]
    env_secret = "env-value-" + uuid.uuid4().hex
    sched = make_scheduler(RUST_LOG="trace")
    lease = sched.lease(kind="renderer", correlation_id="corr-log", env={"PASSWORD": env_secret})
    sched.http.post("/v1/lease", json={"kind": "renderer", "env": {"BAD-KEY": env_secret}})
    httpx.get(f"{sched.url}/v1/leases", headers={"X-Internal-Secret": "wrong-" + SECRET})
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
