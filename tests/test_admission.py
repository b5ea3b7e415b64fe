"""The admission loop (issue 36, docs/concepts/priorities.md#the-admission-loop): one pass
on the leader decides who gets each room, over the whole line at once. Each of the
issue's eight cases is a scenario here, over real HTTP against real scheduler processes
(a static pool where only the bookkeeping matters, real Docker where the warm pool
does), asserting what a caller or an operator would notice; those where replicas matter
run again on two replicas of one PostgreSQL (`cluster`). Then what callers see of the
line: GET /v1/line, the 503's position, a full line, a class as a right. Case 5 (notice,
and a holder that finishes within its grace freeing the room at once) is
tests/test_lease_events.py's and tests/test_priorities.py's; the leader's death and a
line of 1,000 are tests/test_admission_replicas.py's.

The classes are the example's of docs/concepts/priorities.md: `live` preempts, `anim`
may be preempted, `default` neither. Every acquire naming a class sends the owner whose
class it is (`live-control`, `anim`): a class is a right, not a wish."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from opentelemetry.trace import NoOpTracer

from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.lifecycle.admission import Priorities
from openalice_scheduler.lifecycle.policy import OrderedFirstAvailable
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.models import LeaseRequest, LeaseState, WorkerKind
from openalice_scheduler.priorities import parse_priority_classes
from openalice_scheduler.providers.static import StaticProvider
from openalice_scheduler.store import LeaseRecord, LeaseStore
from tests.harness import SECRET, Scheduler, wait_for
from tests.test_lease_features import Call, acquire_in_thread, lookup
from tests.test_replicas import Replicas, replicas  # noqa: F401 - a fixture
from tests.test_warm_pool import POOL_ENV, wait_idle

Make = Callable[..., Scheduler]
Cluster = Callable[..., list[Scheduler]]
CLASSES = {
    "PRIORITY_CLASSES": "live=100:preempts,default=50,anim=10:preemptible",
    "OWNER_PRIORITY_CLASSES": "live-control=live,anim=anim",
}
PREEMPTIONS = "scheduler_preemptions_total"
ONE = "renderer=http://only:8080"
TWO = "renderer=http://r1:8080,http://r2:8080"
# One renderer endpoint and one anim endpoint.
TWO_KINDS = "renderer=http://r:8080;anim=http://a:8080"


# --- helpers ---------------------------------------------------------------------------


@pytest.fixture(params=["one", "two"], ids=["one-replica", "two-pg-replicas"])
def cluster(
    request: pytest.FixtureRequest,
    make_scheduler: Make,
    replicas: Replicas,  # noqa: F811 - the fixture
) -> Cluster:
    """`cluster(workers, **env)`: the schedulers of a static pool of `workers` with the
    example's classes: one process (SQLite), or two replicas sharing a PostgreSQL."""

    def make(workers: str = ONE, **env: str) -> list[Scheduler]:
        settings = {"PROVIDERS": "static", "STATIC_WORKERS": workers, **CLASSES, **env}
        if request.param == "one":
            return [make_scheduler(**settings)]
        return replicas(**settings, STATIC_PROBE_INTERVAL_SECONDS="0")

    return make


def line_of(sched: Scheduler) -> list[dict[str, Any]]:
    """GET /v1/line: the callers waiting, in admission order."""
    response = sched.http.get("/v1/line")
    assert response.status_code == 200, response.text
    return list(response.json())


def wait_line(sched: Scheduler, n: int, timeout: float = 60) -> list[dict[str, Any]]:
    """The line once it holds exactly `n` callers."""
    found: list[list[dict[str, Any]]] = []

    def holds() -> bool:
        found[:] = [line_of(sched)]
        return len(found[0]) == n

    wait_for(holds, timeout, 0.1, what=f"{n} callers in line")
    return found[0]


def served(call: Call, timeout: float = 60) -> dict[str, Any]:
    """The lease a caller in line was given: its answer must be a 200."""
    response = call.response(timeout)
    assert response.status_code == 200, response.text
    return dict(response.json()["lease"])


def state_of(sched: Scheduler, lease_id: str) -> str:
    return str(lookup(sched, lease_id)["state"])


def preemptions(group: list[Scheduler]) -> float:
    return sum(s.metric(PREEMPTIONS, victim_class="anim") for s in group)


def release(sched: Scheduler, lease: dict[str, Any]) -> None:
    response = sched.release(lease["lease_id"], owner=lease.get("owner_id"))
    assert response.status_code == 204, response.text


def race(*calls: Callable[[], httpx.Response]) -> list[Call]:
    """Each call in a thread of its own, all let go at the same moment."""
    gate = threading.Barrier(len(calls))

    def at_gate(call: Callable[[], httpx.Response]) -> Callable[[], httpx.Response]:
        def run() -> httpx.Response:
            gate.wait(30)
            return call()

        return run

    return [Call(at_gate(call)) for call in calls]


class Caller:
    """An acquire on a raw connection of its own, whose caller may hang up (close the
    connection) at a moment the test chooses."""

    def __init__(self, sched: Scheduler, **body: Any) -> None:
        payload = json.dumps({"kind": "renderer", **body}).encode()
        self.sock = socket.create_connection(("127.0.0.1", sched.port), timeout=120)
        self.sock.sendall(
            b"POST /v1/lease HTTP/1.1\r\nHost: scheduler\r\nContent-Type: application/json\r\n"
            + f"X-Internal-Secret: {SECRET}\r\nContent-Length: {len(payload)}\r\n".encode()
            + b"Connection: close\r\n\r\n"
            + payload
        )

    def hang_up(self) -> None:
        self.sock.close()


# --- 1. preemption respects the preemptor's caps in money ---------------------------------


def test_1_a_caller_its_caps_refuse_preempts_no_one_and_is_answered_429(cluster: Cluster) -> None:
    """The issue's scenario: a cap of two workers at 1 $/h each, live-control allowed
    1 $/h and holding one, anim the other."""
    first, *rest = cluster(
        TWO,
        STATIC_PRICE_PER_HOUR="1",
        OWNER_BUDGETS="live-control=1/h",
        PREEMPTION_GRACE_SECONDS="4",
    )
    last = rest[-1] if rest else first
    mine = first.lease(owner_id="live-control", ttl_seconds=600)
    anim = last.lease(owner_id="anim", ttl_seconds=600)
    again = last.acquire(owner_id="live-control", wait_seconds=30, ttl_seconds=600)
    assert again.status_code == 429, again.text
    body = again.json()
    assert body["error"] == "budget_exceeded"
    assert body["cap"] == "OWNER_BUDGETS (live-control=1/h)"
    # The anim lease was not displaced for a caller its caps refuse.
    assert state_of(first, anim["lease_id"]) == "active"
    assert state_of(first, mine["lease_id"]) == "active"
    assert preemptions([first, *rest]) == 0
    assert line_of(first) == []


# --- 2. a preemptor that leaves leaves no claim -------------------------------------------


@pytest.mark.parametrize("leaves", ["hangs-up", "wait-runs-out"])
def test_2_the_room_of_a_preemptor_that_left_goes_at_once_to_the_next_who_fits(
    cluster: Cluster, leaves: str
) -> None:
    first, *rest = cluster(ONE, PREEMPTION_GRACE_SECONDS="600")
    last = rest[-1] if rest else first
    victim = first.lease(owner_id="anim", ttl_seconds=600)
    waiter = acquire_in_thread(last, owner_id="other", wait_seconds=120, ttl_seconds=600)
    wait_line(first, 1)
    if leaves == "hangs-up":
        live: Caller | Call = Caller(first, owner_id="live-control", wait_seconds=120)
    else:
        live = acquire_in_thread(first, owner_id="live-control", wait_seconds=8)
    wait_for(
        lambda: state_of(first, victim["lease_id"]) == "preempting", 30, what="a victim chosen"
    )
    if isinstance(live, Caller):
        live.hang_up()
    else:
        assert live.response(60).status_code == 503
    wait_line(first, 1)  # the preemptor is gone from the line: the waiter alone is left
    # The victim's owner lets go (long before its 600 s grace): the room is the waiter's,
    # at once, not held for the preemptor who left.
    release(last, victim)
    lease = served(waiter, 30)
    assert lease["endpoint"] == "http://only:8080"
    assert preemptions([first, *rest]) == 1
    assert line_of(first) == []


# --- 3. never two victims for one seat ---------------------------------------------------


def test_3_a_victim_whose_preemptor_left_is_adopted_by_the_next_not_a_second(
    cluster: Cluster,
) -> None:
    first, *rest = cluster(TWO, PREEMPTION_GRACE_SECONDS="600")
    last = rest[-1] if rest else first
    older = first.lease(owner_id="anim", correlation_id="older", ttl_seconds=600)
    newer = last.lease(owner_id="anim", correlation_id="newer", ttl_seconds=600)
    gone = Caller(first, owner_id="live-control", wait_seconds=120)
    wait_for(lambda: state_of(first, newer["lease_id"]) == "preempting", 30, what="a victim")
    gone.hang_up()
    wait_line(first, 0)
    # The next live caller speaks for the room already being freed: no second victim.
    live = acquire_in_thread(last, owner_id="live-control", wait_seconds=120, ttl_seconds=600)
    wait_line(first, 1)
    assert state_of(first, older["lease_id"]) == "active"
    assert preemptions([first, *rest]) == 1
    release(first, newer)
    lease = served(live, 30)
    assert lease["endpoint"] == newer["endpoint"]
    assert state_of(first, older["lease_id"]) == "active"
    assert preemptions([first, *rest]) == 1


def test_3_a_release_racing_the_choice_of_a_victim_displaces_no_other(cluster: Cluster) -> None:
    first, *rest = cluster(TWO, PREEMPTION_GRACE_SECONDS="600")
    last = rest[-1] if rest else first
    for round in range(3):
        older = first.lease(owner_id="anim", correlation_id=f"o{round}", ttl_seconds=600)
        newer = last.lease(owner_id="anim", correlation_id=f"n{round}", ttl_seconds=600)
        live, released = race(
            lambda: first.acquire(owner_id="live-control", wait_seconds=60, ttl_seconds=600),
            lambda lease_id=newer["lease_id"]: last.release(lease_id, owner="anim"),
        )
        assert released.response(60).status_code == 204
        response = live.response(60)
        assert response.status_code == 200, response.text
        lease = response.json()["lease"]
        assert lease["endpoint"] == newer["endpoint"]
        # The older anim lease is untouched either way: one seat, at most one victim.
        assert state_of(first, older["lease_id"]) == "active"
        ended = lookup(first, newer["lease_id"])
        assert ended["state"] == "released", ended
        release(first, lease)
        release(first, older)
    assert preemptions([first, *rest]) <= 3


async def test_3_a_victim_released_between_a_passs_look_and_its_preemption_is_the_seat(
    store: LeaseStore,
) -> None:
    """The race made certain, in process: the pass sees two anim leases, the newer is
    released before its preemption is written; the older must not be preempted instead
    (the seat is free: the next pass grants it)."""
    service = LeaseService(
        store,
        [StaticProvider(TWO)],
        OrderedFirstAvailable(),
        Metrics(),
        NoOpTracer(),
        priorities=Priorities(
            parse_priority_classes(CLASSES["PRIORITY_CLASSES"]),
            owners={"live-control": "live", "anim": "anim"},
        ),
        preemption_grace=600,
    )
    anim = LeaseRequest(kind=WorkerKind.renderer, owner_id="anim", ttl_seconds=600)
    older = await service.acquire(anim)
    newer = await service.acquire(anim)
    moved = asyncio.Event()
    service.on_line(moved.set)  # the line may have moved: a caller joined, say
    live = asyncio.create_task(
        service.acquire(
            LeaseRequest(
                kind=WorkerKind.renderer, owner_id="live-control", wait_seconds=60, ttl_seconds=600
            )
        )
    )
    behind = asyncio.create_task(
        service.acquire(LeaseRequest(kind=WorkerKind.renderer, owner_id="other", wait_seconds=60))
    )
    while True:  # no loop runs here: the passes are ours
        moved.clear()
        if len(await service.waiting_line()) == 2:
            break
        await asyncio.wait_for(moved.wait(), 30)
    looked = store.live

    async def look_then_release() -> list[LeaseRecord]:
        seen = await looked()
        await service.release(newer.lease_id, "anim")
        return seen

    store.live = look_then_release  # type: ignore[method-assign]
    try:
        await service.admit()
    finally:
        store.live = looked  # type: ignore[method-assign]
    assert (await service.get(older.lease_id)).state == LeaseState.active
    await service.admit()
    lease = await asyncio.wait_for(live, 30)
    assert lease.endpoint == newer.endpoint
    assert (await service.get(older.lease_id)).state == LeaseState.active
    assert not behind.done()
    behind.cancel()


# --- 4. the warm pool's refill does not skip the line ------------------------------------

POOLED = {**POOL_ENV, **CLASSES, "LOCAL_DOCKER_MAX_WORKERS": "2", "WARM_POOL": "renderer/none=1"}


@pytest.mark.timeout(300)
def test_4_a_room_freed_with_a_caller_waiting_is_the_callers_not_the_refills(
    make_scheduler: Make,
) -> None:
    sched = make_scheduler(**POOLED)
    wait_idle(sched, 1)
    anim = sched.lease(kind="anim", owner_id="someone", ttl_seconds=600)
    renderer = sched.lease(owner_id="someone", ttl_seconds=600)  # the pool's worker
    # The pool is below its target and the cap is reached: its refill waits for a room,
    # and so does a caller whom the pool cannot serve (another kind).
    waiter = acquire_in_thread(
        sched, kind="anim", owner_id="other", wait_seconds=120, ttl_seconds=600
    )
    wait_line(sched, 1)
    release(sched, renderer)
    lease = served(waiter, 150)
    assert lease["kind"] == "anim"
    assert state_of(sched, anim["lease_id"]) == "active"
    running = {c.labels["openalice.scheduler.lease_id"] for c in sched.containers(all=False)}
    assert running == {anim["lease_id"], lease["lease_id"]}, "a refill took a caller's room"


@pytest.mark.timeout(300)
def test_4_a_pool_workers_room_is_given_up_before_a_lease_is_preempted(
    make_scheduler: Make,
) -> None:
    sched = make_scheduler(**POOLED)
    wait_idle(sched, 1)
    anim = sched.lease(kind="anim", owner_id="anim", ttl_seconds=600)
    # The idle renderer cannot serve an anim caller; its room can.
    live = sched.acquire(kind="anim", owner_id="live-control", wait_seconds=120, ttl_seconds=600)
    assert live.status_code == 200, live.text
    assert state_of(sched, anim["lease_id"]) == "active"
    assert preemptions([sched]) == 0


# --- 6. waiters ahead that cannot use a room do not block those behind -------------------


def test_6_a_waiter_over_its_caps_does_not_hold_back_the_one_behind(cluster: Cluster) -> None:
    first, *rest = cluster(TWO, STATIC_PRICE_PER_HOUR="1", OWNER_BUDGETS="live-control=1/h")
    last = rest[-1] if rest else first
    first.lease(owner_id="live-control", ttl_seconds=600)  # at its cap
    held = first.lease(owner_id="someone", ttl_seconds=600)
    behind = acquire_in_thread(last, owner_id="anim", wait_seconds=120, ttl_seconds=600)
    wait_line(first, 1)
    # live-control, the highest class, asks again: no room would take it under its cap.
    again = first.acquire(owner_id="live-control", wait_seconds=60, ttl_seconds=600)
    assert again.status_code == 429, again.text
    release(first, held)
    assert served(behind, 30)["endpoint"] == held["endpoint"]
    assert preemptions([first, *rest]) == 0


def test_6_a_waiter_whose_shape_has_no_room_does_not_block_another_shape(
    cluster: Cluster,
) -> None:
    first, *rest = cluster("renderer=http://r:8080;renderer:mid=http://g:8080")
    last = rest[-1] if rest else first
    plain = first.lease(owner_id="someone", ttl_seconds=600)
    gpu = first.lease(gpu="mid", owner_id="someone", ttl_seconds=600)
    ahead = acquire_in_thread(first, gpu="mid", owner_id="live-control", wait_seconds=120)
    wait_line(first, 1)
    behind = acquire_in_thread(last, owner_id="anim", wait_seconds=120)
    wait_line(first, 2)
    release(last, plain)
    assert served(behind, 30)["endpoint"] == "http://r:8080"
    assert ahead.is_alive()
    release(first, gpu)
    assert served(ahead, 30)["endpoint"] == "http://g:8080"


@pytest.mark.timeout(180)
def test_6_the_callers_of_a_killed_replica_do_not_take_the_room_of_the_living(
    replicas: Replicas,  # noqa: F811 - the fixture
) -> None:
    doomed, alive = replicas(PROVIDERS="static", STATIC_WORKERS=ONE, **CLASSES)
    held = alive.lease(owner_id="someone", ttl_seconds=600)
    ahead = acquire_in_thread(doomed, owner_id="other", wait_seconds=120, ttl_seconds=600)
    wait_line(alive, 1)
    behind = acquire_in_thread(alive, owner_id="anim", wait_seconds=120, ttl_seconds=600)
    wait_line(alive, 2)
    doomed.kill()
    # Freed at once: the dead replica's caller is gone and must not be granted it.
    release(alive, held)
    lease = served(behind, 60)
    assert lease["endpoint"] == "http://only:8080"
    with pytest.raises(httpx.HTTPError):
        ahead.response(30)
    assert [x["lease_id"] for x in alive.leases()] == [lease["lease_id"]]


# --- 7. costs do not grow with the line ---------------------------------------------------


@pytest.mark.timeout(240)
def test_7_a_room_that_suits_only_the_last_of_200_waiters_is_granted_to_it(
    make_scheduler: Make,
) -> None:
    import asyncio

    from tests.test_priorities import _open_waiters

    sched = make_scheduler(PROVIDERS="static", STATIC_WORKERS=TWO_KINDS, **CLASSES)
    sched.lease(owner_id="someone", ttl_seconds=600)
    anim = sched.lease(kind="anim", owner_id="someone", ttl_seconds=600)

    async def run() -> None:
        writers = await _open_waiters(sched, 200, owner_id="other")
        try:
            await asyncio.to_thread(wait_line, sched, 200, 120)
            last = await asyncio.to_thread(
                acquire_in_thread, sched, kind="anim", owner_id="anim", wait_seconds=120
            )
            await asyncio.to_thread(wait_line, sched, 201, 60)
            await asyncio.to_thread(release, sched, anim)
            lease = await asyncio.to_thread(served, last, 30)
            assert lease["endpoint"] == "http://a:8080"
            assert len(await asyncio.to_thread(line_of, sched)) == 200
        finally:
            for writer in writers:
                writer.close()

    asyncio.run(run())


# --- 8. aging, and a retry keeps its place ------------------------------------------------


def test_8_a_low_class_that_waited_long_enough_goes_before_a_newer_higher_one(
    cluster: Cluster,
) -> None:
    first, *rest = cluster(ONE, LINE_AGING_SECONDS="2")
    last = rest[-1] if rest else first
    held = first.lease(owner_id="someone", ttl_seconds=600)
    old = acquire_in_thread(first, owner_id="anim", wait_seconds=120, ttl_seconds=600)
    wait_for(
        lambda: [w["waited_seconds"] >= 2.5 for w in line_of(first)] == [True],
        60,
        0.1,
        what="the anim caller to wait a full LINE_AGING_SECONDS",
    )
    new = acquire_in_thread(last, owner_id="other", wait_seconds=120, ttl_seconds=600)
    order = wait_line(first, 2)
    assert [w["priority_class"] for w in order] == ["anim", "default"]
    release(last, held)
    lease = served(old, 30)
    assert lease["owner_id"] == "anim"
    assert new.is_alive()
    release(first, lease)
    assert served(new, 30)["owner_id"] == "other"


def test_8_a_retry_of_the_same_request_after_its_wait_ran_out_keeps_its_place(
    cluster: Cluster,
) -> None:
    first, *rest = cluster(ONE)
    last = rest[-1] if rest else first
    held = first.lease(owner_id="someone", ttl_seconds=600)
    ask = {"owner_id": "anim", "correlation_id": "shot-7", "ttl_seconds": 600}
    gave_up = first.acquire(wait_seconds=2, **ask)
    assert gave_up.status_code == 503, gave_up.text
    newer = acquire_in_thread(last, owner_id="anim", correlation_id="shot-8", wait_seconds=120)
    wait_line(first, 1)
    retry = acquire_in_thread(last, wait_seconds=120, **ask)
    order = wait_line(first, 2)
    assert [w["correlation_id"] for w in order] == ["shot-7", "shot-8"]
    release(first, held)
    lease = served(retry, 30)
    assert lease["correlation_id"] == "shot-7"
    assert newer.is_alive()
    release(first, lease)
    assert served(newer, 30)["correlation_id"] == "shot-8"


# --- what callers see of the line ----------------------------------------------------------


def test_the_line_shows_positions_in_order_and_never_env(cluster: Cluster) -> None:
    first, *rest = cluster(ONE)
    last = rest[-1] if rest else first
    first.lease(owner_id="someone", ttl_seconds=600)
    secret = "line-secret-" + SECRET[-8:]
    calls = []
    for i, (sched, owner) in enumerate(
        [(first, "anim"), (last, "other"), (first, "live-control"), (last, "other")]
    ):
        calls.append(
            acquire_in_thread(
                sched,
                owner_id=owner,
                correlation_id=f"c{i}",
                wait_seconds=120,
                env={"TOKEN": secret},
            )
        )
        wait_line(first, i + 1)
    for sched in (first, last):
        response = sched.http.get("/v1/line")
        assert secret not in response.text and "env" not in response.json()[0]
        shown = response.json()
        assert [w["position"] for w in shown] == [1, 2, 3, 4]
        assert [w["correlation_id"] for w in shown] == ["c2", "c1", "c3", "c0"]
        assert [w["priority_class"] for w in shown] == ["live", "default", "default", "anim"]
        assert {w["kind"] for w in shown} == {"renderer"}
        assert all(w["waited_seconds"] >= 0 for w in shown)
    assert all(call.is_alive() for call in calls)


def test_a_503_after_a_wait_says_the_position_the_caller_had(cluster: Cluster) -> None:
    first, *rest = cluster(ONE)
    last = rest[-1] if rest else first
    first.lease(owner_id="someone", ttl_seconds=600)
    ahead = acquire_in_thread(first, owner_id="other", wait_seconds=120)
    wait_line(first, 1)
    refused = last.acquire(owner_id="anim", wait_seconds=2)
    assert refused.status_code == 503, refused.text
    assert refused.json()["position"] == 2
    assert int(refused.headers["Retry-After"]) >= 1
    assert ahead.is_alive()


def test_a_full_line_pushes_out_its_lowest_newest_for_a_higher_class(
    make_scheduler: Make,
) -> None:
    sched = make_scheduler(
        PROVIDERS="static",
        STATIC_WORKERS=ONE,
        MAX_WAITING_CALLERS="3",
        MAX_WAITING_PER_OWNER="3",
        **CLASSES,
    )
    sched.lease(owner_id="someone", ttl_seconds=600)
    older = acquire_in_thread(sched, owner_id="anim", correlation_id="a0", wait_seconds=120)
    wait_line(sched, 1)
    newest = acquire_in_thread(sched, owner_id="anim", correlation_id="a1", wait_seconds=120)
    wait_line(sched, 2)
    other = acquire_in_thread(sched, owner_id="other", wait_seconds=120)
    wait_line(sched, 3)
    # Full: another anim caller is refused, a live one pushes the newest anim out.
    refused = sched.acquire(owner_id="anim", wait_seconds=60)
    assert refused.status_code == 503 and refused.json()["error"] == "line_full", refused.text
    live = acquire_in_thread(sched, owner_id="live-control", wait_seconds=120)
    pushed = newest.response(60)
    assert pushed.status_code == 503, pushed.text
    assert pushed.json()["error"] == "line_full"
    assert pushed.json()["position"] == 3
    assert "higher class" in pushed.json()["message"]
    shown = wait_line(sched, 3)
    assert [w["priority_class"] for w in shown] == ["live", "default", "anim"]
    assert older.is_alive() and other.is_alive() and live.is_alive()


def test_a_class_above_the_owners_ceiling_is_a_403_naming_it(make_scheduler: Make) -> None:
    sched = make_scheduler(PROVIDERS="static", STATIC_WORKERS=ONE, **CLASSES)
    refused = sched.acquire(owner_id="anim", priority_class="live")
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"] == "class_not_allowed"
    assert refused.json()["ceiling"] == "anim"
    assert "'anim'" in refused.json()["message"]
    unlisted = sched.acquire(owner_id="stranger", priority_class="live")
    assert unlisted.status_code == 403, unlisted.text
    assert unlisted.json()["ceiling"] == "default"
    assert "UNLISTED_OWNER_MAX_CLASS" in unlisted.json()["message"]
    assert sched.leases() == []
    # At or below the ceiling: served.
    assert sched.lease(owner_id="anim", priority_class="anim")["priority_class"] == "anim"
