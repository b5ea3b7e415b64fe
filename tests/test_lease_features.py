"""Lease features over real HTTP, the service as a separate process: renew, lookup and
filtered listing, idempotent acquire, waiting in line for capacity, per-owner quotas,
the provider policies (with the RunPod emulator) and the providers view.

Most tests use the `static` provider (a fixed pool of endpoints: instant, exclusive, no
containers) where only lease bookkeeping matters, and local Docker where a user would
look at the workers themselves."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from tests.engines import PrivateEngine
from tests.harness import HTTP, SECRET, TLS, Scheduler, docker_client, wait_for
from tests.runpod_emulator import RunPodEmulator
from tests.test_lifecycle import passes

Make = Callable[..., Scheduler]
ALL_STATES = ("provisioning", "active", "releasing", "released", "failed")
KEY = "rpk-features-" + uuid.uuid4().hex
# How far the scheduler's clock may be from ours around one request (same host).
SLACK = timedelta(seconds=2)
# Set at the end of each sweep (loops/sweeper.py): unix time, on the scheduler's clock.
SWEPT = "scheduler_sweep_last_success_timestamp_seconds"


# --- helpers ---------------------------------------------------------------------------


def parse_time(value: str) -> datetime:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def static(
    make_scheduler: Make, workers: str = "renderer=http://only:8080", **env: str
) -> Scheduler:
    return make_scheduler(PROVIDERS="static", STATIC_WORKERS=workers, **env)


def renew(
    sched: Scheduler, lease_id: str, body: dict[str, Any] | None = None, owner: str | None = None
) -> httpx.Response:
    headers = {"X-Lease-Owner": owner} if owner else {}
    if body is None:
        return sched.http.post(f"/v1/lease/{lease_id}/renew", headers=headers)
    return sched.http.post(f"/v1/lease/{lease_id}/renew", json=body, headers=headers)


def lookup(sched: Scheduler, lease_id: str) -> dict[str, Any]:
    response = sched.http.get(f"/v1/lease/{lease_id}")
    assert response.status_code == 200, response.text
    return response.json()


def search(sched: Scheduler, **params: Any) -> list[dict[str, Any]]:
    response = sched.http.get("/v1/leases", params=params)
    assert response.status_code == 200, response.text
    return response.json()


def held_by(sched: Scheduler, owner: str, states: tuple[str, ...] = ALL_STATES) -> list[dict]:
    return search(sched, owner_id=owner, state=list(states))


def ids(leases: list[dict[str, Any]]) -> set[str]:
    return {lease["lease_id"] for lease in leases}


def log_count(sched: Scheduler, text: str) -> int:
    return sched.log().count(text)


# An acquire that found no capacity and is now waiting in line logs this.
WAITING = "waits up to"


class Call(threading.Thread):
    """One HTTP request in a thread; the answer (or the exception) is kept for the test."""

    def __init__(self, fn: Callable[[], httpx.Response]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: httpx.Response | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def response(self, timeout: float = 60) -> httpx.Response:
        self.join(timeout)
        assert not self.is_alive(), f"no answer within {timeout}s"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def acquire_in_thread(sched: Scheduler, timeout: float | httpx.Timeout = 120, **body: Any) -> Call:
    body.setdefault("kind", "renderer")

    def post() -> httpx.Response:
        return HTTP.post(
            f"{sched.url}/v1/lease",
            json=body,
            timeout=timeout,
            headers={"X-Internal-Secret": SECRET},
        )

    return Call(post)


def hangs_up_in_line(sched: Scheduler, owner: str) -> Call:
    """A renderer acquire that would wait 120 s in line, from a caller who gives up after
    3 s without an answer (a read timeout of its own): it closes the connection."""
    return acquire_in_thread(
        sched, timeout=httpx.Timeout(60, read=3), wait_seconds=120, owner_id=owner
    )


def refused(sched: Scheduler) -> float:
    """Acquires refused so far for want of a worker, those whose caller left the line too."""
    return sched.metric("scheduler_acquire_failures_total", reason="no_provider")


def wait_refused(sched: Scheduler, count: float, what: str) -> None:
    wait_for(lambda: refused(sched) >= count, 30, what=what)


def acquire_at_once(sched: Scheduler, n: int, **body: Any) -> list[httpx.Response]:
    """`n` acquires released together by a barrier."""
    body.setdefault("kind", "renderer")
    barrier = threading.Barrier(n)

    def post() -> httpx.Response:
        with httpx.Client(
            verify=TLS, base_url=sched.url, headers={"X-Internal-Secret": SECRET}, timeout=120
        ) as client:
            barrier.wait(30)
            return client.post("/v1/lease", json=body)

    calls = [Call(post) for _ in range(n)]
    return [call.response(150) for call in calls]


# --- 1. renew --------------------------------------------------------------------------


def test_renew_sets_expiry_from_now_defaulting_to_the_lease_ttl(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    lease = sched.lease(ttl_seconds=600)

    before = datetime.now(UTC)
    response = renew(sched, lease["lease_id"])  # no body: the lease's own TTL
    after = datetime.now(UTC)
    assert response.status_code == 200, response.text
    renewed = response.json()
    assert renewed["lease_id"] == lease["lease_id"] and renewed["state"] == "active"
    assert renewed["endpoint"] == lease["endpoint"]
    expires = parse_time(renewed["expires_at"])
    assert (
        before + timedelta(seconds=600) - SLACK <= expires <= after + timedelta(seconds=600) + SLACK
    )
    assert expires > parse_time(lease["expires_at"])

    before = datetime.now(UTC)
    response = renew(sched, lease["lease_id"], {"ttl_seconds": 60})
    after = datetime.now(UTC)
    assert response.status_code == 200, response.text
    expires = parse_time(response.json()["expires_at"])
    # Shorter than before is allowed: expires_at is now + ttl, not old expiry + ttl.
    assert (
        before + timedelta(seconds=60) - SLACK <= expires <= after + timedelta(seconds=60) + SLACK
    )
    # What the caller is told is what the scheduler holds.
    assert lookup(sched, lease["lease_id"])["expires_at"] == response.json()["expires_at"]
    assert [item["expires_at"] for item in sched.leases()] == [response.json()["expires_at"]]

    # An empty JSON object is the same as no body.
    response = renew(sched, lease["lease_id"], {})
    assert response.status_code == 200, response.text
    expires = parse_time(response.json()["expires_at"])
    assert expires >= before + timedelta(seconds=600) - SLACK


def test_renew_is_capped_at_eight_hours(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    lease = sched.lease(ttl_seconds=60)

    before = datetime.now(UTC)
    response = renew(sched, lease["lease_id"], {"ttl_seconds": 28800})
    after = datetime.now(UTC)
    assert response.status_code == 200, response.text
    expires = parse_time(response.json()["expires_at"])
    assert before + timedelta(hours=8) - SLACK <= expires <= after + timedelta(hours=8) + SLACK
    capped = response.json()["expires_at"]

    for bad in (28801, 0, -5, "60"):
        response = renew(sched, lease["lease_id"], {"ttl_seconds": bad})
        assert response.status_code == 422, (bad, response.text)
        body = response.json()
        assert body["error"] == "invalid_request" and body["field"] == "ttl_seconds", body
    # The refused renewals changed nothing.
    assert lookup(sched, lease["lease_id"])["expires_at"] == capped


def test_renew_checks_the_owner_like_release(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    lease = sched.lease(owner_id="anim-service", ttl_seconds=120)

    missing = renew(sched, lease["lease_id"], {"ttl_seconds": 3600})
    assert missing.status_code == 403 and missing.json()["error"] == "forbidden"
    wrong = renew(sched, lease["lease_id"], {"ttl_seconds": 3600}, owner="live-control")
    assert wrong.status_code == 403 and wrong.json()["error"] == "forbidden"
    assert lookup(sched, lease["lease_id"])["expires_at"] == lease["expires_at"]

    right = renew(sched, lease["lease_id"], {"ttl_seconds": 3600}, owner="anim-service")
    assert right.status_code == 200, right.text
    assert parse_time(right.json()["expires_at"]) > parse_time(lease["expires_at"])
    assert right.json()["owner_id"] == "anim-service"

    # A lease without an owner renews without the header.
    sched.release(lease["lease_id"], owner="anim-service")
    plain = sched.lease(ttl_seconds=120)
    assert renew(sched, plain["lease_id"], {"ttl_seconds": 3600}).status_code == 200


def test_renew_never_resurrects_released_or_expired_leases(make_scheduler: Make) -> None:
    sched = make_scheduler(SWEEP_INTERVAL_SECONDS="0.2")

    unknown = renew(sched, str(uuid.uuid4()))
    assert unknown.status_code == 404 and unknown.json()["error"] == "lease_not_found"
    assert renew(sched, "not-a-uuid").status_code == 404

    released = sched.lease(ttl_seconds=600)
    assert sched.release(released["lease_id"]).status_code == 204
    response = renew(sched, released["lease_id"], {"ttl_seconds": 600})
    assert response.status_code == 404 and response.json()["error"] == "lease_not_found"
    assert lookup(sched, released["lease_id"])["state"] == "released"

    expiring = sched.lease(ttl_seconds=1)
    # Past its expiry on the scheduler's own clock, whether or not the sweeper got to it
    # yet: a sweep (woken at the expiry) has finished after it.
    due = parse_time(expiring["expires_at"]).timestamp()
    wait_for(
        lambda: sched.metric(SWEPT) > due,
        30,
        interval=0.1,
        what="a sweep to finish past the lease's expiry",
    )
    response = renew(sched, expiring["lease_id"], {"ttl_seconds": 600})
    assert response.status_code == 404, response.text
    assert response.json()["error"] == "lease_not_found"
    wait_for(
        lambda: lookup(sched, expiring["lease_id"])["state"] == "released",
        30,
        what="the expired lease to be released",
    )
    assert lookup(sched, expiring["lease_id"])["release_reason"] == "expired"
    assert renew(sched, expiring["lease_id"]).status_code == 404
    assert sched.leases() == []
    assert sched.containers() == []


def test_renewing_a_releasing_lease_is_404(make_scheduler: Make, runpod: RunPodEmulator) -> None:
    # RunPod refuses every terminate: the lease stays `releasing` and is retried.
    sched = with_runpod(make_scheduler, runpod)
    lease = sched.lease(kind="renderer", gpu="mid", ttl_seconds=600)
    runpod.fail_next(500, count=1000, op="terminate")
    failed = sched.release(lease["lease_id"])
    assert failed.status_code == 502, failed.text
    assert lookup(sched, lease["lease_id"])["state"] == "releasing"

    response = renew(sched, lease["lease_id"], {"ttl_seconds": 600})
    assert response.status_code == 404, response.text
    assert response.json()["error"] == "lease_not_found"
    assert lookup(sched, lease["lease_id"])["state"] == "releasing"
    assert lease["lease_id"] not in ids(sched.leases())


def test_a_renewed_lease_outlives_its_old_expiry(make_scheduler: Make) -> None:
    sched = make_scheduler(SWEEP_INTERVAL_SECONDS="0.2")
    # Renewed at once (a TTL counts from the request, the worker's start included: on a
    # machine loaded past its cores, with seven test processes on two, that start took
    # over 6 s; 15 s leave room for it), then a control lease, not renewed, that shows
    # the sweeper ran.
    renewed = sched.lease(ttl_seconds=15)
    response = renew(sched, renewed["lease_id"], {"ttl_seconds": 120})
    assert response.status_code == 200, response.text
    control = sched.lease(ttl_seconds=3)
    old_expiry = parse_time(renewed["expires_at"])

    wait_for(
        lambda: lookup(sched, control["lease_id"])["state"] == "released",
        60,
        what="the control lease to expire",
    )
    assert lookup(sched, control["lease_id"])["release_reason"] == "expired"
    # Sweeps past the old expiry, on the scheduler's clock: one finished after it, then
    # two more, the last begun after it (one would have claimed the lease at its old end).
    wait_for(
        lambda: sched.metric(SWEPT) > old_expiry.timestamp(),
        30,
        interval=0.1,
        what="a sweep to finish past the old expiry",
    )
    passes(sched, 2, SWEPT)

    after = lookup(sched, renewed["lease_id"])
    assert after["state"] == "active" and after["release_reason"] is None
    assert after["expires_at"] == response.json()["expires_at"]
    assert ids(sched.leases()) == {renewed["lease_id"]}
    container = docker_client().containers.get(renewed["provider_token"])
    assert container.status == "running"
    assert [c.id for c in sched.containers()] == [renewed["provider_token"]]


# --- 2. lookup and filtered listing ----------------------------------------------------


def test_lookup_shows_a_lease_in_every_state(make_scheduler: Make) -> None:
    sched = static(
        make_scheduler, "renderer=http://a:8080,http://b:8080", SWEEP_INTERVAL_SECONDS="0.2"
    )
    lease = sched.lease(ttl_seconds=600, owner_id="o1", correlation_id="c1")

    active = lookup(sched, lease["lease_id"])
    assert active == lease
    assert active["state"] == "active"
    assert active["release_reason"] is None and active["released_at"] is None

    before = datetime.now(UTC)
    assert sched.release(lease["lease_id"], owner="o1").status_code == 204
    released = lookup(sched, lease["lease_id"])
    assert released["state"] == "released" and released["release_reason"] == "explicit"
    assert before - SLACK <= parse_time(released["released_at"]) <= datetime.now(UTC) + SLACK
    # The rest of the lease is as it was.
    for field in (
        "lease_id",
        "provider",
        "kind",
        "endpoint",
        "created_at",
        "owner_id",
        "correlation_id",
        "provider_token",
    ):
        assert released[field] == lease[field], field

    expiring = sched.lease(ttl_seconds=1)
    wait_for(
        lambda: lookup(sched, expiring["lease_id"])["state"] == "released",
        30,
        what="the lease to expire",
    )
    expired = lookup(sched, expiring["lease_id"])
    assert expired["release_reason"] == "expired"
    assert parse_time(expired["released_at"]) >= parse_time(expiring["expires_at"])

    for lease_id in (str(uuid.uuid4()), "nope"):
        response = sched.http.get(f"/v1/lease/{lease_id}")
        assert response.status_code == 404 and response.json()["error"] == "lease_not_found"
    assert HTTP.get(f"{sched.url}/v1/lease/{lease['lease_id']}").status_code == 401


def test_list_filters_by_state_owner_kind_and_provider(make_scheduler: Make) -> None:
    # One static renderer endpoint; a second renderer and every anim go to local Docker.
    sched = make_scheduler(
        PROVIDERS="static,local-docker", STATIC_WORKERS="renderer=http://static-r:8080"
    )
    r_static = sched.lease(kind="renderer", owner_id="alice")
    r_docker = sched.lease(kind="renderer", owner_id="bob")
    anim = sched.lease(kind="anim", owner_id="alice")
    gone = sched.lease(kind="anim", owner_id="bob")
    assert r_static["provider"] == "static" and r_docker["provider"] == "local-docker"
    assert anim["provider"] == "local-docker"
    assert sched.release(gone["lease_id"], owner="bob").status_code == 204

    # No filter: exactly the active leases, as a JSON array.
    plain = sched.http.get("/v1/leases")
    assert plain.status_code == 200
    assert plain.headers["content-type"].startswith("application/json")
    assert isinstance(plain.json(), list)
    assert ids(plain.json()) == ids([r_static, r_docker, anim])
    assert all(item["state"] == "active" for item in plain.json())

    assert ids(search(sched, state="released")) == {gone["lease_id"]}
    assert search(sched, state="released")[0]["release_reason"] == "explicit"
    assert ids(search(sched, state=["active", "released"])) == ids([r_static, r_docker, anim, gone])
    assert ids(search(sched, owner_id="alice")) == ids([r_static, anim])
    assert ids(search(sched, owner_id="bob")) == {r_docker["lease_id"]}  # active by default
    assert ids(search(sched, owner_id="bob", state=["released"])) == {gone["lease_id"]}
    assert ids(search(sched, kind="anim")) == {anim["lease_id"]}
    assert ids(search(sched, kind="anim", state=list(ALL_STATES))) == ids([anim, gone])
    assert ids(search(sched, provider="static")) == {r_static["lease_id"]}
    assert ids(search(sched, provider="local-docker", owner_id="alice")) == {anim["lease_id"]}
    assert search(sched, owner_id="carol") == []
    assert search(sched, state="failed") == []

    for bad in ({"state": "sleeping"}, {"kind": "painter"}):
        response = sched.http.get("/v1/leases", params=bad)
        assert response.status_code == 422, (bad, response.text)
    assert HTTP.get(f"{sched.url}/v1/leases", params={"state": "active"}).status_code == 401


# --- 3. idempotent acquire -------------------------------------------------------------


def test_same_owner_and_correlation_id_gets_the_same_lease(make_scheduler: Make) -> None:
    sched = make_scheduler()
    first = sched.lease(owner_id="anim", correlation_id="job-1", ttl_seconds=600)
    again = sched.lease(owner_id="anim", correlation_id="job-1", ttl_seconds=600)
    assert again == first
    assert [c.id for c in sched.containers()] == [first["provider_token"]]

    # Another owner with the same correlation_id, or another job, is another lease.
    other_owner = sched.lease(owner_id="live", correlation_id="job-1")
    other_job = sched.lease(owner_id="anim", correlation_id="job-2")
    assert len(ids([first, other_owner, other_job])) == 3
    assert len(sched.containers()) == 3

    # Once released, the same correlation_id makes a new lease and a new worker.
    assert sched.release(first["lease_id"], owner="anim").status_code == 204
    fresh = sched.lease(owner_id="anim", correlation_id="job-1")
    assert fresh["lease_id"] != first["lease_id"]
    assert fresh["provider_token"] != first["provider_token"]
    assert lookup(sched, first["lease_id"])["state"] == "released"
    assert sched.lease(owner_id="anim", correlation_id="job-1") == fresh
    assert {c.id for c in sched.containers()} == {
        fresh["provider_token"],
        other_owner["provider_token"],
        other_job["provider_token"],
    }


@pytest.mark.parametrize("n", [2, 10])
def test_simultaneous_identical_acquires_make_one_worker(make_scheduler: Make, n: int) -> None:
    sched = make_scheduler()
    responses = acquire_at_once(sched, n, owner_id="anim", correlation_id="burst", ttl_seconds=600)
    assert [r.status_code for r in responses] == [200] * n, [r.text for r in responses]
    leases = [r.json()["lease"] for r in responses]
    assert len(ids(leases)) == 1, leases
    assert all(lease["state"] == "active" and lease["endpoint"] for lease in leases)
    assert len(sched.containers()) == 1
    assert sched.containers()[0].id == leases[0]["provider_token"]
    assert ids(sched.leases()) == ids(leases)
    assert held_by(sched, "anim") == [lookup(sched, leases[0]["lease_id"])]
    assert (
        sched.metric(
            "scheduler_leases_acquired_total", provider="local-docker", kind="renderer", gpu="none"
        )
        == 1
    )


def test_a_repeat_while_provisioning_waits_for_that_same_lease(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    runpod.provision_delay = 3
    sched = with_runpod(make_scheduler, runpod)
    first = acquire_in_thread(sched, owner_id="anim", correlation_id="slow", gpu="mid")
    wait_for(lambda: search(sched, state="provisioning"), 30, what="a provisioning lease")
    [provisioning] = search(sched, state="provisioning")
    second = sched.acquire(owner_id="anim", correlation_id="slow", gpu="mid")
    assert second.status_code == 200, second.text
    assert first.response().status_code == 200
    lease = second.json()["lease"]
    assert lease == first.response().json()["lease"]
    assert lease["lease_id"] == provisioning["lease_id"] and lease["state"] == "active"
    assert runpod.call_count("create") == 1
    assert [p.id for p in pods_of(runpod, sched)] == [lease["provider_token"]]


# --- 4. waiting for capacity -----------------------------------------------------------


def test_wait_seconds_is_bounded(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    for bad in (301, -1, "5", 1.5):
        response = sched.acquire(wait_seconds=bad)
        assert response.status_code == 422, (bad, response.text)
        assert response.json()["field"] == "wait_seconds"
    # 300 is accepted (and with capacity free, served at once).
    lease = sched.lease(wait_seconds=300)
    assert lease["endpoint"] == "http://only:8080"


def test_a_waiting_acquire_is_served_when_a_release_frees_capacity(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    holder = sched.lease(ttl_seconds=600)
    full = sched.acquire()
    assert full.status_code == 503, full.text

    started = time.monotonic()
    waiter = acquire_in_thread(sched, wait_seconds=120, owner_id="patient")
    wait_for(lambda: log_count(sched, WAITING) >= 1, 30, what="the acquire to wait in line")
    assert waiter.is_alive()
    assert sched.release(holder["lease_id"]).status_code == 204
    response = waiter.response(100)
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < 120, "served only when its wait ran out"
    lease = response.json()["lease"]
    assert lease["endpoint"] == "http://only:8080" and lease["owner_id"] == "patient"
    assert ids(sched.leases()) == {lease["lease_id"]}


def test_a_waiting_acquire_is_served_when_a_lease_expires(make_scheduler: Make) -> None:
    sched = make_scheduler(LOCAL_DOCKER_MAX_WORKERS="1", SWEEP_INTERVAL_SECONDS="0.5")
    holder = sched.lease(ttl_seconds=3)
    started = time.monotonic()
    response = sched.acquire(wait_seconds=120, ttl_seconds=600)
    assert response.status_code == 200, response.text
    assert time.monotonic() - started < 120, "served only when its wait ran out"
    lease = response.json()["lease"]
    old = lookup(sched, holder["lease_id"])
    assert old["state"] == "released" and old["release_reason"] == "expired"
    assert [c.id for c in sched.containers()] == [lease["provider_token"]]


def test_waiters_are_served_first_come_first_served(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    holder = sched.lease(ttl_seconds=600)
    waiters = []
    for i in range(3):
        waiters.append(acquire_in_thread(sched, wait_seconds=150, owner_id=f"w{i}"))
        # Each one is in line before the next arrives.
        wait_for(lambda n=i + 1: log_count(sched, WAITING) >= n, 30, what=f"waiter {i}")

    current = holder
    for i, waiter in enumerate(waiters):
        assert all(w.is_alive() for w in waiters[i:]), "served with the pool full"
        owner = current["owner_id"]
        assert sched.release(current["lease_id"], owner=owner).status_code == 204
        response = waiter.response(100)
        assert response.status_code == 200, response.text
        current = response.json()["lease"]
        assert current["owner_id"] == f"w{i}"
        assert ids(sched.leases()) == {current["lease_id"]}
    assert sched.release(current["lease_id"], owner="w2").status_code == 204


def test_a_wait_that_runs_out_is_a_503_with_retry_after(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    sched.lease(ttl_seconds=100)
    for wait in (0, 1):
        response = sched.acquire(wait_seconds=wait)
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "no_provider_available"
        assert "static" in response.json()["message"]
        retry_after = int(response.headers["Retry-After"])
        # When the holder's lease ends, at the latest.
        assert 1 <= retry_after <= 100, retry_after
    assert len(sched.leases()) == 1


def test_callers_who_hang_up_leave_the_line_and_get_no_worker(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    holder = sched.lease(ttl_seconds=600)
    gave_up_before = refused(sched)

    # One caller times out on its own side...
    impatient = hangs_up_in_line(sched, "impatient")
    wait_for(lambda: log_count(sched, WAITING) >= 1, 30, what="the first caller in line")
    # ...another closes its connection while in line...
    closer = socket.create_connection(("127.0.0.1", sched.port))
    body = b'{"kind": "renderer", "wait_seconds": 120, "owner_id": "closer"}'
    closer.sendall(
        b"POST /v1/lease HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"X-Internal-Secret: {SECRET}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    wait_for(lambda: log_count(sched, WAITING) >= 2, 30, what="the second caller in line")
    # ...and a third waits patiently behind both.
    patient = acquire_in_thread(sched, wait_seconds=150, owner_id="patient")
    wait_for(lambda: log_count(sched, WAITING) >= 3, 30, what="the third caller in line")

    with pytest.raises(httpx.ReadTimeout):
        impatient.response(30)
    closer.close()
    # Both left the line: each ended as a refused acquire nobody hears about.
    wait_refused(sched, gave_up_before + 2, what="the server to notice both callers left")

    assert sched.release(holder["lease_id"]).status_code == 204
    response = patient.response(100)
    assert response.status_code == 200, response.text
    lease = response.json()["lease"]
    assert lease["owner_id"] == "patient" and lease["endpoint"] == "http://only:8080"
    assert held_by(sched, "impatient") == [] and held_by(sched, "closer") == []
    assert ids(sched.leases()) == {lease["lease_id"]}


def test_a_caller_who_hangs_up_does_not_keep_the_freed_slot(make_scheduler: Make) -> None:
    sched = make_scheduler(LOCAL_DOCKER_MAX_WORKERS="1")
    holder = sched.lease(ttl_seconds=600)
    gone = hangs_up_in_line(sched, "gone")
    wait_for(lambda: log_count(sched, WAITING) >= 1, 30, what="the caller in line")
    with pytest.raises(httpx.ReadTimeout):
        gone.response(30)
    wait_refused(sched, 1, what="the server to notice the caller left")

    assert sched.release(holder["lease_id"]).status_code == 204
    # Nobody holds the freed slot: the next caller gets it without waiting.
    lease = sched.lease(owner_id="next")
    assert held_by(sched, "gone") == []
    assert [c.id for c in sched.containers()] == [lease["provider_token"]]


# --- 5. per-owner quotas ---------------------------------------------------------------


def test_owner_quota(make_scheduler: Make) -> None:
    sched = static(
        make_scheduler,
        "renderer=" + ",".join(f"http://w{i}:8080" for i in range(6)),
        MAX_LEASES_PER_OWNER="2",
        METRICS_OWNER_SERIES="true",
    )
    a1 = sched.lease(owner_id="alice", correlation_id="a1")
    a2 = sched.lease(owner_id="alice", correlation_id="a2")

    third = sched.acquire(owner_id="alice", correlation_id="a3")
    assert third.status_code == 429, third.text
    body = third.json()
    assert body["error"] == "quota_exceeded"
    assert "MAX_LEASES_PER_OWNER" in body["message"] and "2" in body["message"], body
    # Waiting does not get around it.
    assert sched.acquire(owner_id="alice", wait_seconds=1).status_code == 429
    # A repeat of a request already served is that lease, not a third one.
    assert sched.lease(owner_id="alice", correlation_id="a2") == a2

    # Other owners, and callers without an owner, are unaffected.
    b1 = sched.lease(owner_id="bob")
    anonymous = [sched.lease(), sched.lease()]
    assert len(sched.leases()) == 5

    assert sched.metric("scheduler_owner_leases", owner="alice") == 2
    assert sched.metric("scheduler_owner_leases", owner="bob") == 1
    assert sched.metric("scheduler_acquire_failures_total", reason="quota") == 2

    assert sched.release(a1["lease_id"], owner="alice").status_code == 204
    assert sched.metric("scheduler_owner_leases", owner="alice") == 1
    a3 = sched.lease(owner_id="alice", correlation_id="a3")
    assert ids(held_by(sched, "alice", ("active",))) == ids([a2, a3])
    assert sched.acquire(owner_id="alice").status_code == 429
    assert sched.metric("scheduler_acquire_failures_total", reason="quota") == 3
    assert sched.metric("scheduler_owner_leases", owner="alice") == 2
    assert b1["lease_id"] in ids(sched.leases()) and ids(anonymous) <= ids(sched.leases())


# --- 6. policies, with RunPod (the emulator) -------------------------------------------


@pytest.fixture
def runpod(runpod_server: RunPodEmulator) -> Iterator[RunPodEmulator]:
    runpod_server.reset()
    runpod_server.provision_delay = 0
    yield runpod_server
    runpod_server.reset()


def with_runpod(make_scheduler: Make, runpod: RunPodEmulator, **env: str) -> Scheduler:
    return make_scheduler(
        **{
            "PROVIDERS": "runpod,local-docker",
            "RUNPOD_API": "rest",
            "RUNPOD_API_KEY": KEY,
            "RUNPOD_API_BASE_URL": runpod.base_url,
            "RUNPOD_POLL_INTERVAL_SECONDS": "0.1",
            "RUNPOD_CATALOG_TTL_SECONDS": "0",
            **env,
        }
    )


def pods_of(runpod: RunPodEmulator, sched: Scheduler) -> list[Any]:
    return [p for p in runpod.list_pods() if p.name.startswith(f"oa-{sched.instance}-")]


def test_cheapest_first_puts_cpu_work_on_free_local_docker(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    sched = with_runpod(make_scheduler, runpod, POLICY="cheapest-first")
    lease = sched.lease(kind="renderer", gpu="none")
    assert lease["provider"] == "local-docker", lease
    assert runpod.call_count("create") == 0 and pods_of(runpod, sched) == []
    assert [c.id for c in sched.containers()] == [lease["provider_token"]]

    # What only RunPod can place still goes there.
    mid = sched.lease(kind="anim", gpu="mid")
    assert mid["provider"] == "runpod"
    # A region only RunPod has: RunPod, on a CPU pod in that region.
    regional = sched.lease(kind="renderer", gpu="none", region="EU")
    assert regional["provider"] == "runpod"
    [pod] = [p for p in pods_of(runpod, sched) if p.id == regional["provider_token"]]
    assert pod.cpu_id and pod.gpu_id is None and pod.data_center_id.startswith("EU-")
    assert len(sched.containers()) == 1


def test_ordered_first_available_takes_the_first_listed_provider(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    sched = with_runpod(make_scheduler, runpod)  # POLICY unset: ordered-first-available
    lease = sched.lease(kind="renderer", gpu="none")
    assert lease["provider"] == "runpod", lease
    [pod] = pods_of(runpod, sched)
    assert pod.id == lease["provider_token"] and pod.cpu_id and pod.gpu_id is None
    assert sched.containers() == []

    regional = sched.lease(kind="renderer", gpu="none", region="EU")
    assert regional["provider"] == "runpod"
    [pod] = [p for p in pods_of(runpod, sched) if p.id == regional["provider_token"]]
    assert pod.data_center_id.startswith("EU-")

    # A region nobody serves: 503, each provider saying why.
    nowhere = sched.acquire(kind="renderer", region="mars")
    assert nowhere.status_code == 503, nowhere.text
    assert set(nowhere.json()["reasons"]) == {"runpod", "local-docker"}
    assert sched.containers() == []


# --- 8. providers view -----------------------------------------------------------------


def providers_view(sched: Scheduler) -> list[dict[str, Any]]:
    """GET /v1/providers: each provider's view, in the order of PROVIDERS."""
    response = sched.http.get("/v1/providers")
    assert response.status_code == 200, response.text
    return list(response.json())


def the_provider(sched: Scheduler) -> dict[str, Any]:
    """The view of the scheduler's one provider."""
    [view] = providers_view(sched)
    return view


def test_providers_view_is_gated(make_scheduler: Make) -> None:
    sched = static(make_scheduler)
    for headers in ({}, {"X-Internal-Secret": SECRET + "x"}):
        response = HTTP.get(f"{sched.url}/v1/providers", headers=headers)
        assert response.status_code == 401, headers
        assert response.json()["error"] == "unauthorized"


def test_providers_view_shows_static_capacity_and_use(make_scheduler: Make) -> None:
    sched = static(make_scheduler, "renderer=http://a:8080,http://b:8080;anim=http://c:9000")

    before = the_provider(sched)
    assert before["name"] == "static" and before["healthy"] is True
    assert before["in_use"] == 0
    assert before["gpu"] == {"none": {"capacity": 3, "in_use": 0}}

    renderer = sched.lease(kind="renderer")
    sched.lease(kind="anim")
    during = the_provider(sched)
    assert during["in_use"] == 2
    assert during["gpu"] == {"none": {"capacity": 3, "in_use": 2}}

    assert sched.release(renderer["lease_id"]).status_code == 204
    after = the_provider(sched)
    assert after["in_use"] == 1 and after["gpu"]["none"] == {"capacity": 3, "in_use": 1}


def test_providers_view_shows_docker_workers_and_gpus(
    gpu_engine: PrivateEngine, make_scheduler: Make
) -> None:
    sched = make_scheduler(
        engine=gpu_engine.url, LOCAL_DOCKER_MAX_WORKERS="3", LOCAL_GPU_DEVICES="0,1"
    )

    before = the_provider(sched)
    assert before["name"] == "local-docker" and before["healthy"] is True
    assert before["max_workers"] == 3 and before["in_use"] == 0
    assert before["gpu"]["entry"] == {"capacity": 2, "in_use": 0}
    assert before["gpu"]["none"] == {"capacity": 3, "in_use": 0}

    sched.lease(gpu="entry")
    sched.lease(gpu="none")
    during = the_provider(sched)
    assert during["in_use"] == 2
    assert during["gpu"]["entry"] == {"capacity": 2, "in_use": 1}
    assert during["gpu"]["none"] == {"capacity": 3, "in_use": 1}


def test_providers_view_lists_every_provider_in_order(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    sched = with_runpod(make_scheduler, runpod, RUNPOD_MAX_PODS="4")
    sched.lease(kind="anim", gpu="mid")
    runpod_view, docker_view = providers_view(sched)
    assert (runpod_view["name"], docker_view["name"]) == ("runpod", "local-docker")
    assert runpod_view["healthy"] is True and docker_view["healthy"] is True
    assert runpod_view["in_use"] == 1 and runpod_view["max_workers"] == 4
    assert runpod_view["gpu"]["mid"] == {"capacity": 4, "in_use": 1}
    assert docker_view["in_use"] == 0
