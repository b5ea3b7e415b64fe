"""Logs an operator can query: LOG_FORMAT=json, one access line per request with its
request id, the caller's trace honoured, and the HTTP request duration metric."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from openalice_scheduler.app import create_app
from openalice_scheduler.config import Settings
from openalice_scheduler.logs import configure_logging, lease_ref
from openalice_scheduler.providers.base import Availability, WorkerSpec
from openalice_scheduler.providers.static import StaticProvider
from tests.harness import HTTP, SECRET, Scheduler, free_port, run_serve, wait_for
from tests.otlp_receiver import OtlpReceiver

Make = Callable[..., Scheduler]
FIELDS = ("time", "level", "logger", "message")
PASSWORD = "pw-" + uuid.uuid4().hex
ACCESS = "openalice_scheduler.access"
# A caller's W3C trace context: version, trace id, parent span id, flags (sampled).
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


def records(sched: Scheduler) -> list[dict[str, Any]]:
    """Every line the scheduler wrote, each parsed as JSON (a line that is not JSON
    fails the test), each with the fields every record has."""
    parsed = []
    for line in sched.log().splitlines():
        record = json.loads(line)
        assert isinstance(record, dict), line
        for field in FIELDS:
            assert field in record, (field, line)
        parsed.append(record)
    return parsed


def access_line(sched: Scheduler, request_id: str) -> dict[str, Any]:
    found = wait_for(
        lambda: [
            r for r in records(sched) if r["logger"] == ACCESS and r.get("request_id") == request_id
        ],
        10,
        what=f"the access line of request {request_id}",
    )
    assert len(found) == 1, found
    return found[0]


def static(make_scheduler: Make, workers: int = 2, **env: str) -> Scheduler:
    """A scheduler over a static pool: no containers to make, so answers are quick."""
    urls = ",".join(f"http://w{i}:8080" for i in range(workers))
    return make_scheduler(
        PROVIDERS="static", STATIC_WORKERS=f"renderer={urls}", LOG_FORMAT="json", **env
    )


def test_jq_follows_one_lease_from_acquire_to_release(make_scheduler: Make) -> None:
    env_secret = "env-value-" + uuid.uuid4().hex
    sched = make_scheduler(LOG_FORMAT="json", SWEEP_INTERVAL_SECONDS="1")
    lease = sched.lease(
        kind="renderer", owner_id="team-a", correlation_id="job-7", env={"TOKEN": env_secret}
    )
    lease_id = lease["lease_id"]
    renewed = sched.http.post(
        f"/v1/lease/{lease_id}/renew",
        json={"ttl_seconds": 600},
        headers={"X-Lease-Owner": "team-a"},
    )
    assert renewed.status_code == 200, renewed.text
    released = sched.release(lease_id, owner="team-a")
    assert released.status_code == 204, released.text
    # Another lease, left to expire: the sweeper's lines carry its id too.
    expiring = sched.lease(kind="renderer", ttl_seconds=1)["lease_id"]
    wait_for(
        lambda: sched.http.get(f"/v1/lease/{expiring}").json()["state"] == "released",
        30,
        interval=0.2,
        what="the lease to expire",
    )
    sched.stop()

    everything = records(sched)  # every line parses, with time, level, logger, message
    assert env_secret not in sched.log() and SECRET not in sched.log()
    jq = subprocess.run(
        ["jq", "-c", "--arg", "id", lease_id, "select(.lease_id == $id)"],
        input=sched.log(),
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [json.loads(line) for line in jq.stdout.splitlines()]
    assert lines == [r for r in everything if r.get("lease_id") == lease_id]
    service = [r for r in lines if r["logger"] == "openalice_scheduler.service"]
    assert [r["message"].split(" ", 2)[2] for r in service] == [
        "acquired on local-docker (renderer, gpu=none, correlation_id=job-7)",
        f"renewed until {renewed.json()['expires_at']}",
        "released (explicit)",
    ]
    for r in service:
        assert (r["owner_id"], r["correlation_id"]) == ("team-a", "job-7")
        assert r["level"] == "INFO" and r["time"].endswith("Z")
    # The requests that did it: the renew and release access lines name the lease by its
    # route's path parameter; the acquire's is found by the request id it shares with
    # the lease's `acquired` line.
    access = [r for r in lines if r["logger"] == ACCESS]
    assert [(r["method"], r["route"], r["status"]) for r in access] == [
        ("POST", "/v1/lease/{lease_id}/renew", 200),
        ("DELETE", "/v1/lease/{lease_id}", 204),
    ]
    acquire = [
        r
        for r in everything
        if r["logger"] == ACCESS and r["request_id"] == service[0]["request_id"]
    ]
    assert [(r["method"], r["route"], r["status"]) for r in acquire] == [("POST", "/v1/lease", 200)]
    assert service[2]["request_id"] == access[1]["request_id"]

    swept = [
        r["message"]
        for r in everything
        if r.get("lease_id") == expiring and r["logger"] == "openalice_scheduler.service"
    ]
    assert swept[-2:] == [
        f"lease {expiring} expired; releasing",
        f"lease {expiring} released (expired)",
    ]


def test_one_access_line_per_answer_with_its_request_id(make_scheduler: Make) -> None:
    sched = static(make_scheduler, workers=2, MAX_LEASES_PER_OWNER="1")

    responses: dict[str, httpx.Response] = {}

    def call(
        method: str,
        path: str,
        *,
        secret: str | None = SECRET,
        headers: tuple[tuple[str, str], ...] = (),
        **kwargs: Any,
    ) -> str:
        rid = f"req-{uuid.uuid4().hex[:12]}"
        sent = [("X-Request-ID", rid), *headers]
        if secret is not None:
            sent.append(("X-Internal-Secret", secret))
        response = HTTP.request(method, sched.url + path, headers=sent, timeout=30, **kwargs)
        assert response.headers["x-request-id"] == rid  # echoed, on every answer
        responses[rid] = response
        return f"{response.status_code} {rid}"

    answers = {
        "acquire": call("POST", "/v1/lease", json={"kind": "renderer", "owner_id": "a"}),
        "quota": call("POST", "/v1/lease", json={"kind": "renderer", "owner_id": "a"}),
        "second": call("POST", "/v1/lease", json={"kind": "renderer", "owner_id": "b"}),
        "full": call("POST", "/v1/lease", json={"kind": "renderer", "owner_id": "c"}),
        "secret": call("GET", "/v1/leases", secret="wrong-" + SECRET),
        "unknown": call("GET", f"/v1/lease/{uuid.uuid4()}"),
        "invalid": call("POST", "/v1/lease", json={"kind": "toaster"}),
        "health": call("GET", "/health", secret=None),
        "no route": call("GET", f"/nothing/{uuid.uuid4()}", secret=None),
        "too large": call(
            "POST",
            "/v1/lease",
            content=b"x" * (1024 * 1024 + 1),
            headers=(("Content-Type", "application/json"),),
        ),
        "duplicate": call(
            "GET", "/v1/leases", headers=(("X-Lease-Owner", "a"), ("X-Lease-Owner", "b"))
        ),
    }
    a_lease = responses[answers["acquire"].split(" ")[1]].json()["lease"]["lease_id"]
    answers["not yours"] = call("DELETE", f"/v1/lease/{a_lease}", headers=(("X-Lease-Owner", "z"),))

    # Each answer's status, by the method and route its access line names (the route's
    # template, not the path asked for).
    expected = {
        ("POST", "/v1/lease"): {
            "acquire": 200,
            "quota": 429,
            "second": 200,
            "full": 503,
            "invalid": 422,
            "too large": 413,
        },
        ("GET", "/v1/leases"): {"secret": 401, "duplicate": 400},
        ("GET", "/v1/lease/{lease_id}"): {"unknown": 404},
        ("DELETE", "/v1/lease/{lease_id}"): {"not yours": 403},
        ("GET", "/health"): {"health": 200},
        ("GET", "unmatched"): {"no route": 404},
    }
    assert sorted(name for statuses in expected.values() for name in statuses) == sorted(answers)
    for (method, route), statuses in expected.items():
        for name, status in statuses.items():
            got, rid = answers[name].split(" ")
            assert int(got) == status, (name, answers[name])
            line = access_line(sched, rid)
            assert (line["status"], line["method"], line["route"]) == (status, method, route), name
            assert line["duration_ms"] >= 0 and line["path"].startswith("/")
            assert line["message"].startswith(f"{method} {line['path']} {status} ")
    assert access_line(sched, answers["not yours"].split(" ")[1])["lease_id"] == a_lease
    # A caller that leaves halfway through its body gets no answer: logged as 499.
    left = f"left-{uuid.uuid4().hex[:12]}"
    with socket.create_connection(("127.0.0.1", sched.port), timeout=10) as conn:
        conn.sendall(
            b"POST /v1/lease HTTP/1.1\r\nHost: scheduler\r\nX-Request-ID: "
            + left.encode()
            + b"\r\nX-Internal-Secret: "
            + SECRET.encode()
            + b'\r\nContent-Length: 100\r\n\r\n{"kind":'
        )
    assert access_line(sched, left)["status"] == 499

    # The same answers, timed by route template and status.
    assert (
        sched.metric(
            "scheduler_http_request_duration_seconds_count",
            route="/v1/lease",
            method="POST",
            status="200",
        )
        == 2
    )
    assert (
        sched.metric(
            "scheduler_http_request_duration_seconds_count",
            route="/v1/lease",
            method="POST",
            status="429",
        )
        == 1
    )
    assert (
        sched.metric(
            "scheduler_http_request_duration_seconds_count",
            route="/v1/leases",
            method="GET",
            status="401",
        )
        == 1
    )
    # Unknown paths and methods are one series each, whatever the caller sends.
    HTTP.request("BREW", f"{sched.url}/nothing/{uuid.uuid4()}")
    metrics = HTTP.get(f"{sched.url}/metrics").text
    assert (
        sched.metric(
            "scheduler_http_request_duration_seconds_count",
            route="unmatched",
            method="GET",
            status="404",
        )
        == 1
    )
    assert (
        sched.metric(
            "scheduler_http_request_duration_seconds_count",
            route="unmatched",
            method="other",
            status="404",
        )
        == 1
    )
    assert "/nothing/" not in metrics


def test_request_id_is_generated_when_absent_or_unfit(make_scheduler: Make) -> None:
    sched = static(make_scheduler, workers=1)
    response = HTTP.get(f"{sched.url}/health")
    generated = response.headers["x-request-id"]
    assert len(generated) == 32 and int(generated, 16) >= 0  # a uuid4, in hex
    assert access_line(sched, generated)["status"] == 200
    assert HTTP.get(f"{sched.url}/health").headers["x-request-id"] != generated

    # What a caller cannot make the scheduler say back or log as an id: a line folded
    # onto the next (obs-fold, the header continues after CRLF + space), a control
    # character, a space, an overlong value, and the header sent twice.
    forged = [
        b'X-Request-ID: ok\r\n {"level": "ERROR"}\r\n',
        b"X-Request-ID: ok\x1b[2Jcleared\r\n",
        b"X-Request-ID: two words\r\n",
        b"X-Request-ID: " + b"a" * 129 + b"\r\n",
        b"X-Request-ID: first\r\nX-Request-ID: second\r\n",
    ]
    for header in forged:
        answer = _raw_get(sched.port, b"/health", header)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        echoed = [
            line.split(b": ", 1)[1]
            for line in answer.split(b"\r\n")
            if line.lower().startswith(b"x-request-id: ")
        ]
        assert len(echoed) == 1 and len(echoed[0]) == 32, answer
        assert int(echoed[0], 16) >= 0
        assert access_line(sched, echoed[0].decode())["route"] == "/health"
    # A caller's own id of the longest kind kept, as it was.
    kept = "t" * 128
    assert (
        HTTP.get(f"{sched.url}/health", headers={"X-Request-ID": kept}).headers["x-request-id"]
        == kept
    )
    sched.stop()
    log = sched.log()
    assert "cleared" not in log and "two words" not in log and '"second"' not in log


def test_a_page_on_an_allowed_origin_can_send_and_read_the_request_id(make_scheduler: Make) -> None:
    sched = static(make_scheduler, workers=1, CORS_ORIGINS="https://ops.example")
    origin = {"Origin": "https://ops.example"}
    preflight = httpx.options(
        f"{sched.url}/v1/leases",
        headers={
            **origin,
            "Access-Control-Request-Method": "GET",
            "Access-Control-Request-Headers": "x-internal-secret, x-request-id, traceparent",
        },
    )
    assert preflight.status_code == 200, preflight.text
    allowed = preflight.headers["access-control-allow-headers"].lower()
    assert "x-request-id" in allowed and "traceparent" in allowed
    answer = HTTP.get(
        f"{sched.url}/v1/leases",
        headers={**origin, "X-Internal-Secret": SECRET, "X-Request-ID": "page-1"},
    )
    assert answer.headers["x-request-id"] == "page-1"
    assert "x-request-id" in answer.headers["access-control-expose-headers"].lower()


def test_no_request_can_forge_a_json_log_line(make_scheduler: Make) -> None:
    sched = static(make_scheduler, workers=1)
    forged = '{"level": "INFO", "logger": "openalice_scheduler.service", "message": "forged"}'
    response = HTTP.get(
        f"{sched.url}/v1/lease/x%0A{forged}%E2%80%A8", headers={"X-Internal-Secret": SECRET}
    )
    assert response.status_code == 404
    line = access_line(sched, response.headers["x-request-id"])
    assert line["path"] == f"/v1/lease/x\n{forged}\u2028"
    sched.stop()
    assert not [r for r in records(sched) if r["message"] == "forged"]


def test_text_log_has_the_access_lines_too(make_scheduler: Make) -> None:
    sched = make_scheduler(PROVIDERS="static", STATIC_WORKERS="renderer=http://w:8080")
    rid = f"text-{uuid.uuid4().hex}"
    assert HTTP.get(f"{sched.url}/health", headers={"X-Request-ID": rid}).status_code == 200
    line = wait_for(
        lambda: [x for x in sched.log().splitlines() if rid in x], 10, what="the access line"
    )
    assert len(line) == 1 and re.fullmatch(
        r"\S+ \S+ INFO openalice_scheduler\.access: GET /health 200 [\d.]+ ms "
        f"request_id={rid}",
        line[0],
    ), line


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_a_callers_long_string_is_cut_in_the_log(make_scheduler: Make, log_format: str) -> None:
    """Regression: `GET /v1/lease/<60,000 × a>` without the secret was answered 401 and
    logged as a 180 KB access line (the path in `message`, `path` and `lease_id`). Every
    value put in a line is cut at 256 characters, saying how many more there were."""
    sched = make_scheduler(
        PROVIDERS="static", STATIC_WORKERS="renderer=http://w:8080", LOG_FORMAT=log_format
    )
    rid = f"long-{uuid.uuid4().hex}"
    lease_id = "a" * 60_000
    path = f"/v1/lease/{lease_id}"
    response = HTTP.get(f"{sched.url}{path}", headers={"X-Request-ID": rid}, timeout=30)
    assert response.status_code == 401
    [line] = wait_for(
        lambda: [x for x in sched.log().splitlines() if rid in x], 10, what="the access line"
    )
    assert len(line.encode()) < 2048, len(line)
    path_cut = f"{path[:256]}\N{HORIZONTAL ELLIPSIS}(+{len(path) - 256} chars)"
    id_cut = f"{lease_id[:256]}\N{HORIZONTAL ELLIPSIS}(+{len(lease_id) - 256} chars)"
    if log_format == "text":
        assert f"GET {path_cut} 401 " in line, line
    else:
        record = json.loads(line)
        assert (record["path"], record["lease_id"]) == (path_cut, id_cut)
        assert record["message"].startswith(f"GET {path_cut} 401 "), record["message"]

    # A secret across the cut is blanked before the cut: none of it is left.
    rid = f"across-{uuid.uuid4().hex}"
    path = f"/v1/lease/{'a' * 220}{SECRET}{'b' * 100}"
    response = HTTP.get(f"{sched.url}{path}", headers={"X-Request-ID": rid}, timeout=30)
    assert response.status_code == 401
    [line] = wait_for(
        lambda: [x for x in sched.log().splitlines() if rid in x], 10, what="the access line"
    )
    assert "[redacted]" in line and SECRET[:16] not in line, line


def test_traceparent_joins_the_callers_trace(make_scheduler: Make) -> None:
    receiver = OtlpReceiver()
    endpoint = receiver.start()
    try:
        sched = static(make_scheduler, workers=1, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
        response = sched.http.post(
            "/v1/lease", json={"kind": "renderer"}, headers={"traceparent": TRACEPARENT}
        )
        assert response.status_code == 200, response.text
        lease_id = response.json()["lease"]["lease_id"]
        span = wait_for(lambda: receiver.named("POST /v1/lease"), 30, what="request span")[0]
        assert span.trace_id == CALLER_TRACE
        assert span.parent_span_id == CALLER_SPAN
        assert span.attributes["request_id"] == response.headers["x-request-id"]
        provision = wait_for(lambda: receiver.named("provision"), 30, what="provision span")
        assert provision[0].trace_id == CALLER_TRACE
        assert provision[0].parent_span_id == span.span_id

        # The request's log lines name the trace and the request's own span.
        acquired = wait_for(
            lambda: [r for r in records(sched) if r.get("lease_id") == lease_id], 10, what="lines"
        )
        assert acquired[0]["trace_id"] == CALLER_TRACE
        assert acquired[0]["span_id"] == span.span_id
        line = access_line(sched, response.headers["x-request-id"])
        assert (line["trace_id"], line["span_id"]) == (CALLER_TRACE, span.span_id)

        # Without a traceparent the request starts a trace of its own, logged too.
        alone = HTTP.get(f"{sched.url}/health")
        own = wait_for(
            lambda: [
                s
                for s in receiver.named("GET /health")
                if s.attributes["request_id"] == alone.headers["x-request-id"]
            ],
            30,
            what="health span",
        )[0]
        assert own.trace_id != CALLER_TRACE and own.parent_span_id == ""
        assert access_line(sched, alone.headers["x-request-id"])["trace_id"] == own.trace_id

        # Spans are named by route template, a request refused before routing too.
        refused = HTTP.get(f"{sched.url}/v1/lease/{uuid.uuid4()}")
        assert refused.status_code == 401
        named = wait_for(
            lambda: [
                s
                for s in receiver.spans
                if s.attributes.get("request_id") == refused.headers["x-request-id"]
            ],
            30,
            what="refused span",
        )[0]
        assert named.name == "GET /v1/lease/{lease_id}"
        assert named.attributes["http.route"] == "/v1/lease/{lease_id}"
        assert named.attributes["http.response.status_code"] == 401

        # A malformed traceparent is ignored: a trace of its own, no error.
        bad = HTTP.get(f"{sched.url}/health", headers={"traceparent": "00-zz-yy-01"})
        assert bad.status_code == 200
        assert access_line(sched, bad.headers["x-request-id"])["trace_id"] != CALLER_TRACE
    finally:
        receiver.stop()


def test_callers_trace_is_logged_with_tracing_off(make_scheduler: Make) -> None:
    sched = static(make_scheduler, workers=1)
    response = sched.http.post(
        "/v1/lease", json={"kind": "renderer"}, headers={"traceparent": TRACEPARENT}
    )
    assert response.status_code == 200, response.text
    lease_id = response.json()["lease"]["lease_id"]
    assert access_line(sched, response.headers["x-request-id"])["trace_id"] == CALLER_TRACE
    acquired = [r for r in records(sched) if r.get("lease_id") == lease_id]
    assert acquired and acquired[0]["trace_id"] == CALLER_TRACE
    # A request without one has no trace: no trace_id rather than a made-up one.
    plain = HTTP.get(f"{sched.url}/health")
    assert "trace_id" not in access_line(sched, plain.headers["x-request-id"])


def test_secrets_never_reach_the_json_log(make_scheduler: Make) -> None:
    env_secret = "env-value-" + uuid.uuid4().hex
    sched = static(make_scheduler, workers=1, RUST_LOG="trace")
    lease = sched.lease(kind="renderer", correlation_id="corr-json", env={"PASSWORD": env_secret})
    sched.http.post("/v1/lease", json={"kind": "renderer", "env": {"BAD-KEY": env_secret}})
    HTTP.get(f"{sched.url}/v1/leases", headers={"X-Internal-Secret": "wrong-" + SECRET})
    # A caller that sends the secret as its request id gets it back; the log does not.
    echoed = HTTP.get(f"{sched.url}/health", headers={"X-Request-ID": SECRET})
    assert echoed.headers["x-request-id"] == SECRET
    sched.release(lease["lease_id"])
    sched.stop()
    log = sched.log()
    assert lease["lease_id"] in log and "corr-json" in log and '"level": "DEBUG"' in log
    assert env_secret not in log
    assert SECRET not in log
    assert [r for r in records(sched) if r.get("request_id") == "[redacted]"]


def test_an_unknown_log_format_stops_start_up(tmp_path: Path) -> None:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "INTERNAL_SECRET": SECRET,
        "SCHEDULER_HOST": "127.0.0.1",
        "SCHEDULER_PORT": str(free_port()),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'fmt.db'}",
        "LOG_FORMAT": "xml",
        "PROVIDERS": "static",
        "STATIC_WORKERS": "renderer=http://only:8080",
    }
    done = run_serve(env, tmp_path, timeout=30)
    assert done.returncode != 0
    assert "LOG_FORMAT" in done.stderr and "json" in done.stderr, done.stderr


# --- the formatter itself, in this process ---------------------------------------------


def json_logging() -> None:
    """JSON logging as `serve` sets it up, with a database password among the secrets."""
    settings = Settings(  # type: ignore[call-arg]
        internal_secret=SECRET, database_url=f"postgresql://u:{PASSWORD}@db.invalid/x"
    )
    configure_logging("info", settings.secrets(), "json")


def written(capsys: pytest.CaptureFixture[str]) -> list[Any]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines()]


def test_json_records_keep_one_line_and_no_secret(
    real_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    json_logging()
    log = logging.getLogger("openalice_scheduler.service")
    forged = '"}\n{"level": "INFO", "message": "lease x released"}'
    log.info("lease %s acquired (correlation_id=%s)", "l-1", f"job{forged}\u2028")
    try:
        raise ConnectionError(f"store at postgresql://u:{PASSWORD}@db refused {SECRET}")
    except ConnectionError:
        log.exception("state store unavailable")
    log.warning("retrying with %s", {"password": PASSWORD, "tries": [SECRET, 3]})
    first, second, third = written(capsys)
    assert first["message"] == f"lease l-1 acquired (correlation_id=job{forged}\u2028)"
    assert second["message"] == "state store unavailable"
    assert "Traceback (most recent call last)" in second["exc_info"]
    assert (
        "ConnectionError: store at postgresql://u:[redacted]@db refused [redacted]"
        in (second["exc_info"])
    )
    assert PASSWORD not in third["message"] and SECRET not in third["message"]
    assert third["level"] == "WARNING"


def test_lease_ref_reads_as_the_id_and_adds_the_fields(
    real_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    class Spec:
        lease_id, owner_id, correlation_id = "l-2", "team-b", None

    json_logging()
    log = logging.getLogger("openalice_scheduler.service")
    log.info("lease %s released (%s)", lease_ref(Spec()), "explicit")
    log.info("lease %s gone", lease_ref("l-3"))
    released, gone = written(capsys)
    assert released["message"] == "lease l-2 released (explicit)"
    assert (released["lease_id"], released["owner_id"]) == ("l-2", "team-b")
    assert "correlation_id" not in released
    assert gone["lease_id"] == "l-3" and "owner_id" not in gone


class _Broken(StaticProvider):
    """A provider with a bug: what the scheduler does with an error nobody expected."""

    async def available(self, spec: WorkerSpec) -> Availability:
        raise RuntimeError(f"a bug, with {SECRET} in its message")


def test_an_unexpected_error_is_answered_with_its_request_id(
    real_logging: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # In this process, over real HTTP: the service's own processes have no such bug.
    json_logging()
    workers = "renderer=http://w:8080"
    settings = Settings(  # type: ignore[call-arg]
        internal_secret=SECRET,
        providers="static",
        static_workers=workers,
        database_url=f"sqlite:///{tmp_path / 'broken.db'}",
    )
    app = create_app(settings, providers=[_Broken(workers)])
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, what="the server to start")
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        response = HTTP.post(
            f"{url}/v1/lease",
            json={"kind": "renderer"},
            timeout=30,
            headers={"X-Internal-Secret": SECRET, "X-Request-ID": "crash-1"},
        )
    finally:
        server.should_exit = True
        thread.join(30)
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "crash-1"
    assert response.json()["message"] == "internal error; see the scheduler's log"
    lines = [r for r in written(capsys) if r.get("request_id") == "crash-1"]
    assert [r["status"] for r in lines if r["logger"] == ACCESS] == [500]
    # The traceback is logged with the request's id, and without the secret.
    failed = [r for r in lines if r["message"] == "unexpected error: RuntimeError"]
    assert len(failed) == 1 and "RuntimeError: a bug, with [redacted]" in failed[0]["exc_info"]
    assert SECRET not in json.dumps(lines)


def _raw_get(port: int, path: bytes, headers: bytes) -> bytes:
    """A GET sent byte for byte (httpx refuses to send malformed headers); the answer's
    status line and headers."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            b"GET "
            + path
            + b" HTTP/1.1\r\nHost: scheduler\r\n"
            + headers
            + b"Connection: close\r\n\r\n"
        )
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n\r\n", 1)[0]


def test_the_provider_secrets_are_redacted_too(
    real_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    runpod_key, modal_secret = "rpk-" + "x" * 24, "as-" + "y" * 24
    settings = Settings(  # type: ignore[call-arg]
        internal_secret=SECRET, runpod_api_key=runpod_key, modal_token_secret=modal_secret
    )
    configure_logging("info", settings.secrets(), "json")
    logging.getLogger("openalice_scheduler.service").warning(
        "a provider said %s and %s", runpod_key, modal_secret
    )
    [record] = written(capsys)
    assert record["message"] == "a provider said [redacted] and [redacted]"
