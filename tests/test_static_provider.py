"""The `static` provider over real HTTP: a fixed pool of already-running endpoints from
STATIC_WORKERS, each leased to one caller at a time."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.harness import SECRET, TLS, Scheduler, printed_lines, run_serve, wait_for

Make = Callable[..., Scheduler]
POOL = "renderer=http://a:8080,http://b:8080;anim=http://c:9000"


def static(make_scheduler: Make, workers: str = POOL, **env: str) -> Scheduler:
    return make_scheduler(PROVIDERS="static", STATIC_WORKERS=workers, **env)


def acquire_at_once(sched: Scheduler, n: int, **body: object) -> list[httpx.Response]:
    barrier = threading.Barrier(n)
    results: list[httpx.Response | BaseException] = [RuntimeError("no answer")] * n

    def post(i: int) -> None:
        try:
            with httpx.Client(
                verify=TLS, base_url=sched.url, headers={"X-Internal-Secret": SECRET}, timeout=60
            ) as client:
                barrier.wait(30)
                results[i] = client.post("/v1/lease", json={"kind": "renderer", **body})
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            results[i] = exc

    threads = [threading.Thread(target=post, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    responses = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        responses.append(result)
    return responses


def test_each_endpoint_is_leased_exclusively(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    responses = acquire_at_once(sched, 2)
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    leases = [r.json()["lease"] for r in responses]
    assert sorted(lease["endpoint"] for lease in leases) == ["http://a:8080", "http://b:8080"]
    for response, lease in zip(responses, leases, strict=True):
        assert response.json()["provider"] == "static" == lease["provider"]
        assert lease["provider_token"] == lease["endpoint"] and lease["state"] == "active"

    third = sched.acquire()
    assert third.status_code == 503, third.text
    body = third.json()
    assert body["error"] == "no_provider_available"
    assert "static" in body["reasons"] and "static endpoints" in body["message"], body
    assert "Retry-After" in third.headers

    # Release returns the endpoint to the pool: the next renderer gets exactly it.
    freed = leases[0]
    assert sched.release(freed["lease_id"]).status_code == 204
    again = sched.lease()
    assert again["endpoint"] == freed["endpoint"]
    assert sched.acquire().status_code == 503
    assert {lease["endpoint"] for lease in sched.leases()} == {"http://a:8080", "http://b:8080"}


def test_kinds_and_gpu_classes_have_their_own_pools(make_scheduler: Make) -> None:
    sched = static(make_scheduler, POOL + ";renderer:entry=http://gpu-box:8080")
    anim = sched.lease(kind="anim")
    assert anim["endpoint"] == "http://c:9000" and anim["provider"] == "static"
    busy = sched.acquire(kind="anim")
    assert busy.status_code == 503, busy.text

    # Renderers are untouched by the anim pool being empty.
    assert sched.lease(kind="renderer")["endpoint"] in ("http://a:8080", "http://b:8080")
    gpu = sched.lease(kind="renderer", gpu="entry")
    assert gpu["endpoint"] == "http://gpu-box:8080" and gpu["gpu"] == "entry"

    for request in ({"kind": "anim", "gpu": "entry"}, {"kind": "renderer", "gpu": "high"}):
        response = sched.acquire(**request)
        assert response.status_code == 503, response.text
        assert "no static" in response.json()["reasons"]["static"], response.json()

    assert sched.release(anim["lease_id"]).status_code == 204
    assert sched.lease(kind="anim")["endpoint"] == "http://c:9000"


def test_providers_show_capacity_and_use_per_kind(make_scheduler: Make) -> None:
    """2 renderer endpoints and 1 anim endpoint, the renderers both leased: the view says
    no renderer is free (the next renderer acquire gets 503) and the anim one is."""
    sched = static(make_scheduler)
    for _ in range(2):
        sched.lease(kind="renderer")
    assert sched.acquire(kind="renderer").status_code == 503
    [view] = sched.http.get("/v1/providers").json()
    assert view["kinds"] == {
        "anim": {"none": {"capacity": 1, "in_use": 0}},
        "renderer": {"none": {"capacity": 2, "in_use": 2}},
    }
    assert view["gpu"] == {"none": {"capacity": 3, "in_use": 2}}  # the totals
    # And a 503 body says why, without internal flags.
    body = sched.acquire(kind="renderer").json()
    assert body["error"] == "no_provider_available" and "at_capacity" not in body


def test_static_workers_are_never_created_nor_destroyed(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    lease = sched.lease(ttl_seconds=600)
    assert sched.containers() == []
    assert sched.release(lease["lease_id"]).status_code == 204
    assert sched.containers() == []
    assert (
        sched.metric("scheduler_leases_released_total", provider="static", reason="explicit") == 1
    )
    assert sched.metric("scheduler_provision_seconds_count", provider="static") == 1


def test_static_pool_with_region(make_scheduler: Make) -> None:
    sched = static(make_scheduler, STATIC_REGION="eu-west")
    assert sched.lease(region="eu-west")["provider"] == "static"
    elsewhere = sched.acquire(region="us-east")
    assert elsewhere.status_code == 503, elsewhere.text
    assert "region" in elsewhere.json()["reasons"]["static"]


def _serve(make_scheduler: Make, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    s = make_scheduler(start=False, PROVIDERS="static", **env)
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "STATIC_"))}
    full.update(s.env, SCHEDULER_PORT=str(s.port), PYTHONUNBUFFERED="1")
    return run_serve(full, tmp_path)


def test_bad_static_workers_stop_start_up_with_one_clear_line(
    make_scheduler: Make, tmp_path: Path
) -> None:
    cases = {
        "renderer": "not kind=url",
        "painter=http://a:8080": "painter",
        "renderer:ultra=http://a:8080": "renderer:ultra",
        "renderer=ftp://a:8080": "ftp://a:8080",
        "renderer=http://a:8080,http://a:8080": "listed twice",
        " ; ": "no worker endpoints",
        None: "not set",
    }
    for value, expected in cases.items():
        env = {} if value is None else {"STATIC_WORKERS": value}
        result = _serve(make_scheduler, tmp_path, **env)
        lines = printed_lines(result.stderr)
        assert result.returncode != 0, (value, result.stderr)
        assert len(lines) == 1, (value, result.stderr)
        assert "STATIC_WORKERS" in lines[0] and expected in lines[0], (value, lines)
        assert "Traceback" not in result.stderr and SECRET not in result.stderr


class Endpoint:
    """A real static endpoint on loopback that can stop answering and come back (its
    port kept), as an on-premises worker whose process dies and is restarted."""

    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread: threading.Thread | None = None

    def start(self) -> Endpoint:
        if self.server.socket.fileno() < 0:  # stopped before: the same port again
            self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), _Answer)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.server.shutdown()
            self.server.server_close()
            self._thread = None


class _Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_args: object) -> None:
        return None


def test_a_static_endpoint_that_stops_answering_leaves_rotation_and_comes_back(
    make_scheduler: Make,
) -> None:
    endpoint = Endpoint().start()
    try:
        sched = static(
            make_scheduler,
            f"renderer={endpoint.url}",
            STATIC_PROBE_INTERVAL_SECONDS="0.2",
            RENDERER_READY_PATH="/healthz",
        )
        lease = sched.lease(kind="renderer", owner_id="me")
        endpoint.stop()
        # Three failed probes in a row: its lease ends `lost`, its cause unknown.
        ended = wait_for(
            lambda: (
                (now := sched.http.get(f"/v1/lease/{lease['lease_id']}").json())["state"]
                == "released"
                and now
            ),
            30,
            what="the lease of the dead endpoint ended",
        )
        assert (ended["release_reason"], ended["lost_cause"]) == ("lost", "unknown")
        renewal = sched.http.post(
            f"/v1/lease/{lease['lease_id']}/renew", headers={"X-Lease-Owner": "me"}
        )
        assert renewal.status_code == 409 and renewal.json()["error"] == "worker_lost"
        # Out of rotation: nobody is given it while it does not answer.
        refused = sched.acquire(kind="renderer")
        assert refused.status_code == 503, refused.text
        assert "out of rotation" in refused.json()["reasons"]["static"]
        assert sched.metric("scheduler_workers_lost_total", provider="static", cause="unknown") == 1

        endpoint.start()  # back: in rotation once it passes again
        back = wait_for(
            lambda: sched.acquire(kind="renderer").json().get("lease"), 30, what="in rotation"
        )
        assert back["endpoint"] == endpoint.url
    finally:
        endpoint.stop()
