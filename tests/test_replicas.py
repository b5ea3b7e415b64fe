"""Several scheduler replicas on one PostgreSQL, sharing nothing else (issue 5).

Each test starts two real scheduler processes with the same SCHEDULER_INSTANCE,
DOCKER_NETWORK and DATABASE_URL (a fresh PostgreSQL database), started together the way
a compose file starts them (both migrate the empty database at once), and drives them
over HTTP against the real Docker engine:

- capacity caps, GPU exclusivity, idempotent acquire and per-owner quotas hold when the
  competing requests are split across the replicas;
- each expired lease is released exactly once, by one replica or the other;
- a replica killed with SIGKILL mid-provision (its container start held by the Docker
  proxy of tests/dockerproxy.py) is noticed by the other, which resolves the lease within
  a reconcile interval plus the replica timeout, also when the dead replica held the
  reconcile lock;
- PostgreSQL stopped and started while traffic runs: acquires answer 503
  `store_unavailable` meanwhile, never a 500; the replicas recover on their own; no lease
  is lost or duplicated; and an outage longer than the replica timeout, which silences
  every replica's heartbeat, does not make one replica resolve another's provisions.

The PostgreSQL server stopped in those last tests is a private one (initdb in a temp
directory, same binaries), so that stopping it disturbs no other test using the shared
server.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from openalice_scheduler.store.postgres import advisory_key
from tests.dockerproxy import DockerProxy
from tests.engines import PrivateEngine
from tests.harness import SECRET, TLS, Scheduler, clean_up_all, database_url, wait_for
from tests.pgproxy import PgProxy
from tests.postgres import PrivatePostgres
from tests.test_lifecycle import passes

LEASE_LABEL = "openalice.scheduler.lease_id"
START = r"^POST /v[\d.]+/containers/[^/?]+/start(\?|$)"
LIST = r"^GET /v[\d.]+/containers/json"
RELEASED = "scheduler_leases_released_total"
ACQUIRED = "scheduler_leases_acquired_total"
# The labels of renderer leases without a GPU on local Docker.
PLAIN_RENDERERS = {"provider": "local-docker", "kind": "renderer", "gpu": "none"}
# Set at the end of each sweep (loops/sweeper.py): unix time, on the replica's clock.
SWEPT = "scheduler_sweep_last_success_timestamp_seconds"

Replicas = Callable[..., list[Scheduler]]


# --- helpers ---------------------------------------------------------------------------


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[Replicas]:
    """`replicas(n=2, database=None, each=None, **env)`: n scheduler processes sharing a
    fresh PostgreSQL database (or `database`), one SCHEDULER_INSTANCE and one
    DOCKER_NETWORK (and one `engine=`, see Scheduler); `each[i]` adds environment for
    replica i only. They are started together and are all killed, their containers
    removed, at the end of the test."""
    started: list[Scheduler] = []
    with contextlib.ExitStack() as stack:

        def make(
            n: int = 2,
            database: str | None = None,
            each: list[dict[str, str]] | None = None,
            **env: str,
        ) -> list[Scheduler]:
            url = database or stack.enter_context(database_url("postgresql", tmp_path))
            instance = f"t-{uuid.uuid4().hex[:10]}"
            group = []
            for i in range(n):
                s = Scheduler(
                    tmp_path,
                    SCHEDULER_INSTANCE=instance,
                    DOCKER_NETWORK=f"oa-{instance}",
                    DATABASE_URL=url,
                    **{**env, **(each[i] if each else {})},
                )
                s.log_path = tmp_path / f"scheduler-{instance}-{i}.log"
                started.append(s)
                group.append(s)
            for s in group:
                s.start(wait=False)
            for s in group:
                s.wait_ready()
            return group

        try:
            yield make
        finally:
            clean_up_all(started)


def burst(
    calls: list[tuple[Scheduler, dict[str, Any]]], paths: list[str] | None = None
) -> list[httpx.Response]:
    """POST /v1/lease (or `paths[i]`) for every (replica, body) at the same moment; the
    answers in order. A transport error (a dropped connection, a refused one) fails the
    test."""

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        clients = {
            s.url: httpx.AsyncClient(
                verify=TLS,
                base_url=s.url,
                timeout=180,
                limits=limits,
                headers={"X-Internal-Secret": SECRET},
            )
            for s, _ in calls
        }
        # Every task waits at the gate, and this one with them: all go at once.
        gate = asyncio.Barrier(len(calls) + 1)

        async def one(s: Scheduler, path: str, body: dict[str, Any]) -> httpx.Response:
            await gate.wait()
            return await clients[s.url].post(path, json=body)

        try:
            where = paths or ["/v1/lease"] * len(calls)
            tasks = [
                asyncio.create_task(one(s, p, b)) for (s, b), p in zip(calls, where, strict=True)
            ]
            await gate.wait()
            return await asyncio.gather(*tasks)
        finally:
            for client in clients.values():
                await client.aclose()

    return asyncio.run(run())


def split(n: int, group: list[Scheduler], body: dict[str, Any]) -> list[tuple[Scheduler, dict]]:
    """n copies of `body`, sent to the replicas in turn."""
    return [(group[i % len(group)], dict(body)) for i in range(n)]


def statuses(responses: list[httpx.Response]) -> Counter[int]:
    return Counter(r.status_code for r in responses)


def expect(responses: list[httpx.Response], counts: dict[int, int]) -> None:
    """So many answers of each status; else fail showing one body of each."""
    got = statuses(responses)
    bodies = {r.status_code: r.text[:500] for r in responses}
    assert got == counts, f"{dict(got)}, one answer of each: {bodies}"


def lease_ids_of(containers: list[Any]) -> list[str]:
    return sorted(c.labels[LEASE_LABEL] for c in containers)


def listed(s: Scheduler, **params: Any) -> list[str]:
    response = s.http.get("/v1/leases", params=params)
    assert response.status_code == 200, response.text
    return sorted(lease["lease_id"] for lease in response.json())


def total(group: list[Scheduler], name: str, **labels: str) -> float:
    return sum(s.metric(name, **labels) for s in group)


def device_ids(container: Any) -> list[str]:
    """The GPU ids of a container as inspected (`containers.get`)."""
    requests = container.attrs["HostConfig"]["DeviceRequests"] or []
    return [d for r in requests for d in r["DeviceIDs"]]


def release_all(group: list[Scheduler], leases: list[dict[str, Any]]) -> None:
    """Release each lease (204), through the replicas in turn."""
    for i, lease in enumerate(leases):
        s = group[(i + 1) % len(group)]
        response = s.release(lease["lease_id"], owner=lease.get("owner_id"))
        assert response.status_code == 204, response.text


# --- capacity, GPUs, idempotency and quotas across replicas --------------------------------


@pytest.mark.timeout(300)
def test_capacity_cap_holds_across_replicas(replicas: Replicas) -> None:
    # 100 callers at once for 10 workers: ten times the cap, split over the replicas.
    group = replicas(LOCAL_DOCKER_MAX_WORKERS="10")
    # Warm up (database pools, engine ping, network), so that neither replica is behind.
    warm = burst(split(10, group, {"kind": "anim"}))
    expect(warm, {200: 10})
    release_all(group, [r.json()["lease"] for r in warm])

    responses = burst(split(100, group, {"kind": "renderer", "ttl_seconds": 600}))

    expect(responses, {200: 10, 503: 90})
    refused = [r.json() for r in responses if r.status_code == 503]
    assert {body["error"] for body in refused} == {"no_provider_available"}
    assert all("10/10" in body["message"] for body in refused), refused[0]
    leases = [r.json()["lease"] for r in responses if r.status_code == 200]
    ids = sorted(lease["lease_id"] for lease in leases)
    assert len(set(ids)) == 10
    served_by = Counter(group[i % 2].url for i, r in enumerate(responses) if r.status_code == 200)
    print(f"\n200s per replica: {sorted(served_by.values())}")

    # Both replicas list the same 20 leases; exactly 20 containers run, one per lease.
    for s in group:
        assert listed(s) == ids
    containers = group[0].containers()
    assert lease_ids_of(containers) == ids
    assert all(c.status == "running" for c in containers)
    assert sorted(c.id for c in containers) == sorted(x["provider_token"] for x in leases)
    assert total(group, ACQUIRED, **PLAIN_RENDERERS) == 10

    # Full on either replica; once one lease is gone, either can take one more.
    for s in group:
        assert s.acquire(kind="anim").status_code == 503
    release_all(group, leases[:1])
    extra = group[1].lease(kind="anim")
    assert group[0].acquire(kind="anim").status_code == 503
    release_all(group, [*leases[1:], extra])
    assert group[0].containers() == []
    for s in group:
        assert listed(s) == []


@pytest.mark.timeout(240)
def test_gpu_devices_are_exclusive_across_replicas(
    gpu_engine: PrivateEngine, replicas: Replicas
) -> None:
    group = replicas(engine=gpu_engine.url, LOCAL_GPU_DEVICES="0,1")
    responses = burst(split(12, group, {"kind": "renderer", "gpu": "entry"}))

    expect(responses, {200: 2, 503: 10})
    for r in responses:
        if r.status_code == 503:
            assert "all 2 GPU devices are leased" in r.json()["message"], r.text
    leases = [r.json()["lease"] for r in responses if r.status_code == 200]
    containers = group[0].containers()
    assert lease_ids_of(containers) == sorted(x["lease_id"] for x in leases)
    assert sorted(d for c in containers for d in device_ids(c)) == ["0", "1"]

    # A device freed on one replica is handed out by the other.
    release_all(group, leases[:1])
    freed = device_ids(gpu_engine.client.containers.get(leases[1]["provider_token"]))
    again = burst(split(4, group, {"kind": "anim", "gpu": "entry"}))
    expect(again, {200: 1, 503: 3})
    (lease,) = [r.json()["lease"] for r in again if r.status_code == 200]
    assert device_ids(gpu_engine.client.containers.get(lease["provider_token"])) != freed
    release_all(group, [leases[1], lease])
    assert group[0].containers() == []


@pytest.mark.timeout(240)
def test_idempotent_acquire_across_replicas(replicas: Replicas) -> None:
    group = replicas()
    rounds = 4
    calls = []
    for n in range(rounds):
        body = {"kind": "renderer", "owner_id": "anim-service", "correlation_id": f"job-{n}"}
        calls += split(4, group, body)  # twice to each replica, all at once
    responses = burst(calls)

    expect(responses, {200: 4 * rounds})
    by_job: dict[str, set[str]] = {}
    for r in responses:
        lease = r.json()["lease"]
        by_job.setdefault(lease["correlation_id"], set()).add(lease["lease_id"])
    assert sorted(by_job) == [f"job-{n}" for n in range(rounds)]
    assert all(len(ids) == 1 for ids in by_job.values()), by_job
    ids = sorted(next(iter(ids)) for ids in by_job.values())
    # One lease and one container per request, whichever replica answered.
    assert lease_ids_of(group[0].containers()) == ids
    for s in group:
        assert listed(s) == ids
    assert total(group, ACQUIRED, **PLAIN_RENDERERS) == rounds

    # Once released, the same request makes a new lease (on either replica, once).
    first = next(r.json()["lease"] for r in responses)
    release_all(group, [first])
    again = burst(
        split(
            2,
            group,
            {
                "kind": "renderer",
                "owner_id": "anim-service",
                "correlation_id": first["correlation_id"],
            },
        )
    )
    expect(again, {200: 2})
    (renewed,) = {r.json()["lease"]["lease_id"] for r in again}
    assert renewed != first["lease_id"]
    assert len(group[0].containers()) == rounds
    leases = [group[0].http.get(f"/v1/lease/{i}").json() for i in listed(group[0])]
    release_all(group, leases)
    assert group[0].containers() == []


@pytest.mark.timeout(240)
def test_owner_quota_holds_across_replicas(replicas: Replicas) -> None:
    group = replicas(MAX_LEASES_PER_OWNER="3")
    responses = burst(
        split(12, group, {"kind": "anim", "owner_id": "live-control"})
        + split(2, group, {"kind": "anim", "owner_id": "someone-else"})
    )

    expect(responses, {200: 5, 429: 9})
    quota = [r.json() for r in responses if r.status_code == 429]
    assert {b["error"] for b in quota} == {"quota_exceeded"} and {b["limit"] for b in quota} == {3}
    leases = [r.json()["lease"] for r in responses if r.status_code == 200]
    assert Counter(x["owner_id"] for x in leases) == {"live-control": 3, "someone-else": 2}
    assert lease_ids_of(group[0].containers()) == sorted(x["lease_id"] for x in leases)
    assert total(group, "scheduler_acquire_failures_total", reason="quota") == 9

    # One released through replica B frees one slot for replica A.
    mine = [x for x in leases if x["owner_id"] == "live-control"]
    release_all(group, mine[:1])
    assert group[0].acquire(kind="anim", owner_id="live-control").status_code == 200
    assert group[1].acquire(kind="anim", owner_id="live-control").status_code == 429
    live = [group[0].http.get(f"/v1/lease/{i}").json() for i in listed(group[0])]
    release_all(group, live)
    assert group[0].containers() == []


# --- expiry: each lease released once, by one replica or the other ---------------------------


@pytest.mark.timeout(300)
def test_expired_leases_are_released_exactly_once_across_replicas(replicas: Replicas) -> None:
    group = replicas(SWEEP_INTERVAL_SECONDS="0.2", RECONCILE_INTERVAL_SECONDS="2")
    n = 30
    # All made at once, with a TTL none outlives while the others are made (that takes
    # longer on a loaded host), then all renewed at once to expire together a few seconds
    # later: both sweepers go for them.
    responses = burst(split(n, group, {"kind": "renderer", "ttl_seconds": 600}))
    expect(responses, {200: n})
    leases = [r.json()["lease"] for r in responses]
    ids = sorted(x["lease_id"] for x in leases)
    assert lease_ids_of(group[0].containers()) == ids
    renew = [f"/v1/lease/{lease_id}/renew" for lease_id in ids]
    expect(burst(split(n, group, {"ttl_seconds": 3}), renew), {200: n})

    def all_released() -> bool:
        return (
            total(group, RELEASED, provider="local-docker", reason="expired") >= n
            and all(listed(s) == [] for s in group)
            and group[0].containers() == []
        )

    wait_for(all_released, 120, interval=0.5, what="every lease to expire")
    # A second release, were there one, would be counted by now: each replica's sweeper
    # has run two more passes, the second wholly after every lease was gone.
    for s in group:
        passes(s, 2, SWEPT)
    per_replica = [s.metric(RELEASED, provider="local-docker", reason="expired") for s in group]
    print(f"\nexpired releases per replica: {per_replica}")
    assert sum(per_replica) == n
    # Nothing else was counted: no worker destroyed by a release passed for an orphan.
    for reason in ("explicit", "failed", "lost", "orphan"):
        assert total(group, RELEASED, provider="local-docker", reason=reason) == 0
    assert total(group, "scheduler_release_failures_total", provider="local-docker") == 0
    for lease_id in ids:
        record = group[0].http.get(f"/v1/lease/{lease_id}").json()
        assert (record["state"], record["release_reason"]) == ("released", "expired")
    # Claimed once, too: one sweeper (of either replica) took each lease.
    claims = Counter(
        m[1] for s in group for m in re.finditer(r"lease (\S+) expired; releasing$", s.log(), re.M)
    )
    assert claims == dict.fromkeys(ids, 1)
    assert group[0].containers() == []


@pytest.mark.timeout(180)
def test_a_replica_whose_every_connection_waits_still_heartbeats(replicas: Replicas) -> None:
    """A burst that holds every connection of a replica's pool (each acquire waiting on
    the provider's lock in its transaction, held here from outside) must not silence its
    heartbeat: the other replicas would take it for dead and fail its provisions (seen
    under a loaded burst: a lease answered 502 "resolved by reconciliation")."""
    (busy,) = replicas(
        n=1,
        PROVIDERS="static",
        STATIC_WORKERS="renderer=http://a:8080",
        RECONCILE_INTERVAL_SECONDS="2",  # a heartbeat every second
    )
    database = busy.env["DATABASE_URL"]

    def sql(query: str) -> str:
        done = subprocess.run(
            ["psql", database, "-tAc", query], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    holder = subprocess.Popen(
        ["psql", database, "-q"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    assert holder.stdin is not None
    holder.stdin.write(f"SELECT pg_advisory_lock({advisory_key('provider:static')});\n")
    holder.stdin.flush()
    # Held before the burst starts (under load psql took longer to start than the burst
    # to be served, and no acquire waited).
    held = (
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = 'psql' "
        "AND a.datname = current_database()"
    )
    wait_for(lambda: int(sql(held)) >= 1, 30, interval=0.1, what="the provider's lock held")
    answers: list[httpx.Response] = []
    calls = threading.Thread(
        target=lambda: answers.extend(burst(split(45, [busy], {"kind": "renderer"})))
    )
    try:
        calls.start()
        waiting = (
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        wait_for(lambda: int(sql(waiting)) >= 30, 60, interval=0.2, what="30 acquires waiting")
        first = int(sql("SELECT max(heartbeat_at) FROM replicas"))
        wait_for(
            lambda: int(sql("SELECT max(heartbeat_at) FROM replicas")) > first + 2_000_000,
            10,
            interval=0.2,
            what="two more heartbeats while every pooled connection waits",
        )
    finally:
        holder.stdin.write("SELECT pg_advisory_unlock_all();\n\\q\n")
        holder.stdin.close()
        holder.wait(30)
        calls.join(120)
    expect(answers, {200: 1, 503: 44})


# --- kill -9 a replica mid-provision ------------------------------------------------------


@pytest.fixture
def proxy() -> Iterator[DockerProxy]:
    """A fault-injecting Docker proxy on a short socket path."""
    where = Path(tempfile.mkdtemp(prefix="oa-proxy-", dir="/tmp"))
    p = DockerProxy(where / "docker.sock").start()
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(where, ignore_errors=True)


@dataclass
class Call:
    """One HTTP call made in a thread of its own."""

    fn: Callable[[], httpx.Response]
    response: httpx.Response | None = None
    error: Exception | None = None
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.response = self.fn()
        except httpx.HTTPError as exc:
            self.error = exc

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("holding_lock", [False, True], ids=["idle", "holding-reconcile-lock"])
def test_replica_killed_mid_provision_is_resolved_by_the_other(
    replicas: Replicas, proxy: DockerProxy, holding_lock: bool
) -> None:
    """Replica B talks to Docker through the proxy, which holds its container start; B is
    killed with SIGKILL. Replica A notices B's silence (heartbeat every 1 s, gone after
    4 s) and resolves B's lease within a reconcile interval (2 s) plus that timeout.
    With `holding_lock`, B dies in the middle of a reconcile pass (its container listing
    held too), holding the reconcile lock: A must not wait for the lock to expire."""
    interval, replica_timeout = 2.0, 4.0
    a, b = replicas(RECONCILE_INTERVAL_SECONDS=str(interval), each=[{}, {"DOCKER_HOST": proxy.url}])
    keep_a = a.lease(kind="anim", owner_id="anim-service")
    keep_b = b.lease(kind="renderer", correlation_id="made-by-b")

    proxy.delay(START, 120)
    held = 1
    if holding_lock:
        proxy.delay(LIST, 120)
        held = 2
    with httpx.Client(
        verify=TLS, base_url=b.url, headers={"X-Internal-Secret": SECRET}, timeout=180
    ) as client:
        call = Call(
            lambda: client.post("/v1/lease", json={"kind": "renderer", "correlation_id": "doomed"})
        )
        proxy.wait_held(held, timeout=60)
        (doomed,) = wait_for(
            lambda: listed(a, state="provisioning"), 30, what="the provisioning lease"
        )
        assert [
            c.labels[LEASE_LABEL] for c in a.containers() if c.labels[LEASE_LABEL] == doomed
        ] == [doomed]

        b.kill()
        killed = time.monotonic()
        proxy.clear()
        call.join(60)
    assert call.response is None and isinstance(call.error, httpx.TransportError)

    def resolved() -> bool:
        return a.http.get(f"/v1/lease/{doomed}").json()["state"] == "failed"

    wait_for(resolved, 60, interval=0.1, what="replica A to resolve the lease")
    took = time.monotonic() - killed
    print(
        f"\nlease of the killed replica resolved {took:.2f} s after the kill "
        f"(bound {interval + replica_timeout:g} s + slack)"
    )
    record = a.http.get(f"/v1/lease/{doomed}").json()
    assert record["release_reason"] == "failed"
    wait_for(lambda: doomed not in lease_ids_of(a.containers()), 10, what="its container gone")
    assert took <= interval + replica_timeout + 3.0
    assert a.metric(RELEASED, provider="local-docker", reason="failed") == 1

    # Nothing else was touched: both earlier leases are listed and their workers run.
    expected = sorted([keep_a["lease_id"], keep_b["lease_id"]])
    assert listed(a) == expected
    assert lease_ids_of(a.containers()) == expected
    assert all(c.status == "running" for c in a.containers())
    assert a.metric(RELEASED, provider="local-docker", reason="orphan") == 0
    # The survivor serves, and releases what the dead replica made.
    fresh = a.lease(kind="renderer")
    release_all([a], [keep_a, keep_b, fresh])
    assert a.containers() == []


# --- PostgreSQL stopped and started while traffic runs -----------------------------------


class Traffic:
    """Clients looping acquire (and now and then a release, and lookups) against the
    replicas, from threads, until stopped. Records every answer; an answer outside the
    contract for a store outage (a 500, a dropped connection, an unexpected code) is
    kept in `unexpected`. A release answered 503 is tried again on the client's next
    round, until it is confirmed, as a careful client would; stopped clients finish
    their releases first."""

    def __init__(self, group: list[Scheduler], clients_per_replica: int, pause: float) -> None:
        self.group = group
        self.pause = pause
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.acquired: dict[str, dict[str, Any]] = {}  # lease_id -> lease, from a 200
        self.released: set[str] = set()
        # (replica index, operation, status, error code) -> count
        self.answers: Counter[tuple[int, str, int, str]] = Counter()
        self.unexpected: list[str] = []
        # (time, replica, operation, status, error code) of every answer
        self.log: list[tuple[float, int, str, int, str]] = []
        self.threads = [
            threading.Thread(target=self._client, args=(i % len(group), i), daemon=True)
            for i in range(clients_per_replica * len(group))
        ]

    def start(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(120)
            assert not thread.is_alive(), "a traffic client is stuck"

    def count(
        self,
        replica: int,
        op: str,
        status: int,
        error: str = "",
        since: float = 0.0,
        until: float = float("inf"),
    ) -> int:
        with self.lock:
            return sum(
                1
                for t, r, o, s, e in self.log
                if since <= t < until
                and r == replica
                and o == op
                and s == status
                and (not error or e == error)
            )

    def first(self, replica: int, op: str, status: int, since: float) -> float:
        with self.lock:
            return min(
                t
                for t, r, o, s, _ in self.log
                if t >= since and r == replica and o == op and s == status
            )

    def _note(
        self, replica: int, op: str, response: httpx.Response, allowed: dict[int, set[str]]
    ) -> None:
        error = ""
        if response.status_code >= 400:
            try:
                error = response.json().get("error", "")
            except ValueError:
                error = "<not json>"
        with self.lock:
            self.answers[(replica, op, response.status_code, error)] += 1
            self.log.append((time.monotonic(), replica, op, response.status_code, error))
            want = allowed.get(response.status_code)
            if want is None or (want and error not in want):
                self.unexpected.append(
                    f"replica {replica} {op}: {response.status_code} {response.text[:300]}"
                )

    def _client(self, replica: int, n: int) -> None:
        s = self.group[replica]
        outage = {"store_unavailable"}
        mine: list[dict[str, Any]] = []
        releasing: list[dict[str, Any]] = []  # leases to release; a 503 leaves one here
        retried: set[str] = set()
        with httpx.Client(
            verify=TLS, base_url=s.url, headers={"X-Internal-Secret": SECRET}, timeout=60
        ) as http:
            i = 0
            while not self.stopping.is_set():
                i += 1
                try:
                    r = http.post(
                        "/v1/lease",
                        json={
                            "kind": "renderer",
                            "ttl_seconds": 3600,
                            "correlation_id": f"c{n}-{i}",
                        },
                    )
                    self._note(replica, "acquire", r, {200: set(), 503: outage})
                    if r.status_code == 200:
                        lease = r.json()["lease"]
                        with self.lock:
                            assert lease["lease_id"] not in self.acquired
                            self.acquired[lease["lease_id"]] = lease
                        mine.append(lease)
                    if i % 4 == 0 and mine:
                        releasing.append(mine.pop(0))
                    if releasing:
                        self._release(http, replica, releasing, retried)
                    if i % 5 == 0 and mine:
                        got = http.get(f"/v1/lease/{mine[-1]['lease_id']}")
                        self._note(replica, "get", got, {200: set(), 503: outage})
                    if i % 7 == 0:
                        self._note(
                            replica, "list", http.get("/v1/leases"), {200: set(), 503: outage}
                        )
                except httpx.HTTPError as exc:
                    with self.lock:
                        self.unexpected.append(f"replica {replica}: {type(exc).__name__} {exc}")
                # The traffic's pace (a caller's think time, not a wait for anything);
                # cut short when the traffic stops.
                self.stopping.wait(self.pause)

            def settled() -> bool:
                if releasing:
                    self._release(http, replica, releasing, retried)
                return not releasing

            with contextlib.suppress(AssertionError):
                wait_for(settled, 60, interval=0.1, what="releases to be confirmed")
            if releasing:
                with self.lock:
                    self.unexpected.append(f"replica {replica}: releases never confirmed")

    def _release(
        self, http: httpx.Client, replica: int, releasing: list[dict[str, Any]], retried: set[str]
    ) -> None:
        lease_id = releasing[0]["lease_id"]
        r = http.delete(f"/v1/lease/{lease_id}")
        # 404 only on a retry: the earlier attempt did release it, its answer was lost.
        again = {404: {"lease_not_found"}} if lease_id in retried else {}
        self._note(replica, "release", r, {204: set(), 503: {"store_unavailable"}, **again})
        if r.status_code in (204, 404):
            releasing.pop(0)
            with self.lock:
                self.released.add(lease_id)
        else:
            retried.add(lease_id)


def test_a_lease_committed_when_its_acquire_answered_503_is_released(
    make_scheduler: Callable[..., Scheduler], private_pg: PrivatePostgres
) -> None:
    """PostgreSQL committed a static lease, and the connection was cut before its answer
    came back (as when the server stops right after a commit): the caller was answered
    503, so no lease may stay behind. Found in the outage test below, where one such
    lease stayed active (its endpoint held) until its TTL. The scheduler looks it up
    once the store answers and releases it (reason `failed`); its endpoint is free."""
    proxy = PgProxy(private_pg.root).start()
    try:
        s = make_scheduler(
            DATABASE_URL=f"postgresql://{private_pg.user}@/oa?host={proxy.dir}",
            PROVIDERS="static",
            STATIC_WORKERS="renderer=http://answer-lost.invalid:1",
            SWEEP_INTERVAL_SECONDS="1",
        )
        proxy.lose_commit_answer(b"answer-lost.invalid")  # a value of its INSERT only
        answer = s.acquire(kind="renderer")
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"] == "store_unavailable"
        assert proxy.cut.is_set()
        wait_for(lambda: listed(s, state="released"), 30, what="the lease to be released")
        assert listed(s, state="active") == []
        [lease] = s.http.get("/v1/leases", params={"state": "released"}).json()
        assert lease["release_reason"] == "failed"
        assert s.acquire(kind="renderer").status_code == 200  # the one endpoint is free
    finally:
        proxy.close()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("provider", ["static", "local-docker"])
def test_postgres_stopped_and_started_under_traffic(
    replicas: Replicas, private_pg: PrivatePostgres, provider: str
) -> None:
    if provider == "static":
        endpoints = ",".join(f"http://w{i}:1" for i in range(4000))
        env = {"PROVIDERS": "static", "STATIC_WORKERS": f"renderer={endpoints}"}
        clients, pause, enough = 3, 0.03, 40
    else:
        env = {"PROVIDERS": "local-docker"}
        clients, pause, enough = 2, 0.1, 6
    group = replicas(
        database=private_pg.url, RECONCILE_INTERVAL_SECONDS="2", SWEEP_INTERVAL_SECONDS="1", **env
    )
    pids = [s.proc.pid for s in group if s.proc is not None]
    traffic = Traffic(group, clients_per_replica=clients, pause=pause).start()
    try:
        wait_for(
            lambda: all(traffic.count(i, "acquire", 200) >= enough for i in range(2)),
            120,
            interval=0.1,
            what="traffic to flow",
        )
        try:
            private_pg.stop()
            # Down for a good while: longer than the replica timeout (1 s heartbeat,
            # 4 s), so that the replicas' heartbeats all lapse.
            stopped_at = time.monotonic()
            wait_for(
                lambda: all(
                    traffic.count(i, "acquire", 503, "store_unavailable", since=stopped_at) >= 3
                    for i in range(2)
                ),
                60,
                interval=0.1,
                what="both replicas to answer 503 while it is down",
            )
            # Down for 5 s at least, and still answered: each replica answers 503 then.
            wait_for(
                lambda: all(
                    traffic.count(i, "acquire", 503, "store_unavailable", since=stopped_at + 5)
                    for i in range(2)
                ),
                60,
                interval=0.1,
                what="both replicas to answer 503 five seconds into the outage",
            )
        finally:
            starting_at = time.monotonic()
            if not private_pg.running():
                private_pg.start()
        up_at = time.monotonic()
        wait_for(
            lambda: all(traffic.count(i, "acquire", 200, since=up_at) >= enough for i in range(2)),
            120,
            interval=0.1,
            what="both replicas to serve again",
        )
        recovered = [traffic.first(i, "acquire", 200, since=up_at) - up_at for i in range(2)]
        # Traffic goes on a while after: as much again, and releases, on each replica.
        again_at = time.monotonic()
        wait_for(
            lambda: all(
                traffic.count(i, "acquire", 200, since=again_at) >= enough
                and traffic.count(i, "release", 204, since=again_at) >= 1
                for i in range(2)
            ),
            120,
            interval=0.1,
            what="traffic to go on after the recovery",
        )
    finally:
        traffic.stop()

    answers = Counter()
    for (_, op, status, error), n in traffic.answers.items():
        answers[f"{op} {status} {error}".strip()] += n
    print(
        f"\n{provider}: acquired {len(traffic.acquired)}, released {len(traffic.released)}; "
        f"store down {starting_at - stopped_at:.1f} s; first 200 after it is back: "
        f"{', '.join(f'{x:.2f} s' for x in recovered)}; answers: {dict(sorted(answers.items()))}"
    )
    assert traffic.unexpected == []
    # While it was down, nothing was acquired (a second in, in-flight requests are done).
    assert [
        traffic.count(i, "acquire", 200, since=stopped_at + 1, until=starting_at) for i in range(2)
    ] == [0, 0]
    # Never restarted: the same processes serve.
    assert [s.proc.pid for s in group if s.proc is not None and s.proc.poll() is None] == pids

    # No lease lost, none duplicated: each lease a client got a 200 for (and did not
    # release) is listed exactly once, by either replica; nothing else is.
    held = sorted(set(traffic.acquired) - traffic.released)
    for s in group:
        wait_for(
            lambda s=s: not listed(s, state="provisioning"),
            30,
            what="provisions cut short by the outage to be resolved",
        )
        # A lease committed while its caller was answered 503 (the server stopped
        # right after a COMMIT) is released once the store answers: wait for that too.
        with contextlib.suppress(AssertionError):
            wait_for(
                lambda s=s: sorted(x["lease_id"] for x in s.leases()) == held,
                30,
                what="leases committed during the outage to be settled",
            )
        leases = s.leases()
        assert sorted(x["lease_id"] for x in leases) == held
        for lease in leases:
            assert lease == traffic.acquired[lease["lease_id"]]
    assert not listed(group[0], state="releasing")
    for lease_id in sorted(traffic.released)[:50]:
        assert group[1].http.get(f"/v1/lease/{lease_id}").json()["state"] == "released"

    # Workers match the listed leases one to one.
    leases = group[0].leases()
    tokens = [x["provider_token"] for x in leases]
    assert len(set(tokens)) == len(tokens) == len(held)
    if provider == "local-docker":
        wait_for(
            lambda: lease_ids_of(group[0].containers()) == held,
            30,
            what="containers to match the leases",
        )
        assert sorted(c.id for c in group[0].containers()) == sorted(tokens)


@pytest.mark.timeout(300)
def test_store_outage_longer_than_the_replica_timeout_declares_no_replica_dead(
    replicas: Replicas, private_pg: PrivatePostgres, proxy: DockerProxy
) -> None:
    """While the store is down no replica can heartbeat, so once it is back every other
    replica looks silent for longer than the replica timeout. Replica A must not take
    that for B's death: B's provision, under way all along (its container start held by
    the proxy), completes and its caller gets the lease. B is also slow to come back
    (paused for 1.5 s after the store is: SIGSTOP), so that A surely reconciles before
    B's first heartbeat."""
    a, b = replicas(
        database=private_pg.url,
        RECONCILE_INTERVAL_SECONDS="2",
        each=[{}, {"DOCKER_HOST": proxy.url}],
    )
    proxy.delay(START, 14)
    with httpx.Client(
        verify=TLS, base_url=b.url, headers={"X-Internal-Secret": SECRET}, timeout=180
    ) as client:
        call = Call(
            lambda: client.post("/v1/lease", json={"kind": "renderer", "correlation_id": "patient"})
        )
        proxy.wait_held(1, timeout=60)
        assert b.proc is not None
        try:
            private_pg.stop()
            b.proc.send_signal(signal.SIGSTOP)
            # sleep: the outage must outlast the replica timeout (4 s) on the replicas'
            # own clocks, which no test can move; the store, down, shows nothing meanwhile.
            time.sleep(6.0)  # > 4 s: B's last heartbeat is older than that when it is back
            private_pg.start()
            # A reconciles (it retries every second) while B is silent: a pass of A's
            # finishes with the store back.
            passes(a, 1)
        finally:
            if not private_pg.running():
                private_pg.start()
            b.proc.send_signal(signal.SIGCONT)
        # The start is let through some 6 s later.
        call.join(60)
    assert call.error is None, call.error
    assert call.response is not None and call.response.status_code == 200, call.response.text
    lease = call.response.json()["lease"]
    assert lease["state"] == "active"
    assert listed(a) == [lease["lease_id"]]
    assert [c.id for c in a.containers()] == [lease["provider_token"]]
    assert a.containers()[0].status == "running"
    assert total([a, b], RELEASED, provider="local-docker", reason="failed") == 0
    release_all([a, b], [lease])
    assert a.containers() == []
