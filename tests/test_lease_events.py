"""A lease's event stream (issue 36, "Notice, not post-mortem"): `GET /v1/lease/{id}/events`
over real HTTP against real scheduler processes, and the clients that listen to it.

A caller used to hear of its preemption at its next renewal (a third of its TTL): with a
long TTL, after its worker was gone. The stream tells it at once, and a client that
finishes at once frees the room for the preemptor long before the grace is over.

Preemption is set up as tests/test_priorities.py does it, on a static pool with room for
one renderer: an `anim` lease, then a `live` caller willing to wait. Every acquire with a
class names it through its owner (`OWNER_PRIORITY_CLASSES`), never above it."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from openalice_scheduler.client import AsyncSchedulerClient, PreemptNotice, SchedulerClient
from tests.harness import HTTP, SECRET, Scheduler, docker_client, on_static, wait_for
from tests.test_lease_features import Call, acquire_in_thread, lookup, parse_time
from tests.test_replicas import Replicas, replicas  # noqa: F401 - the fixture

Make = Callable[..., Scheduler]
CLASSES = {
    "PRIORITY_CLASSES": "live=100:preempts,default=50,anim=10:preemptible",
    "OWNER_PRIORITY_CLASSES": "live-control=live,anim=anim",
}
ONE_RENDERER = "renderer=http://only:8080"
# A grace and a TTL long enough that renewals alone (every 100 s) would hear of a
# preemption only after a minute and more: the stream must tell it long before.
LONG_GRACE = {"PREEMPTION_GRACE_SECONDS": "60"}
LONG_TTL = 300


class Stream(threading.Thread):
    """`GET /v1/lease/{id}/events` read in a thread: the events as (name, lease), the
    status and content type of the answer, whether the stream ended."""

    def __init__(self, sched: Scheduler, lease_id: str, owner: str | None = None) -> None:
        super().__init__(daemon=True)
        self.url = f"{sched.url}/v1/lease/{lease_id}/events"
        self.headers = {"X-Internal-Secret": SECRET}
        if owner is not None:
            self.headers["X-Lease-Owner"] = owner
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.comments = 0
        self.status: int | None = None
        self.content_type = ""
        self.ended = threading.Event()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            timeout = httpx.Timeout(30, read=120)
            with HTTP.stream("GET", self.url, headers=self.headers, timeout=timeout) as answer:
                self.status = answer.status_code
                self.content_type = answer.headers.get("content-type", "")
                name, data = "", ""
                for line in answer.iter_lines():
                    if line.startswith(":"):
                        self.comments += 1
                    elif line.startswith("event: "):
                        name = line.removeprefix("event: ")
                    elif line.startswith("data: "):
                        data = line.removeprefix("data: ")
                    elif not line and data:
                        self.events.append((name, json.loads(data)))
                        name, data = "", ""
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc
        finally:
            self.ended.set()

    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    def wait(self, name: str, timeout: float = 60) -> dict[str, Any]:
        """The lease of the first event `name`, once it has come."""
        found = wait_for(
            lambda: next((lease for got, lease in self.events if got == name), None),
            timeout,
            what=f"a {name!r} event (so far {self.names()}, error {self.error!r})",
        )
        return dict(found)

    def finished(self, timeout: float = 60) -> list[str]:
        assert self.ended.wait(timeout), f"the stream did not end; events {self.names()}"
        assert self.error is None, self.error
        return self.names()


def pool(make_scheduler: Make, **env: str) -> Scheduler:
    """A static pool with room for one renderer, and the example's classes."""
    return on_static(make_scheduler, ONE_RENDERER, **CLASSES, **env)


def live_caller(sched: Scheduler) -> Call:
    """A live caller, willing to wait, who finds the pool full: it preempts."""
    return acquire_in_thread(
        sched, owner_id="live-control", wait_seconds=120, ttl_seconds=600, timeout=180
    )


def served(call: Call, timeout: float = 120) -> dict[str, Any]:
    answer = call.response(timeout)
    assert answer.status_code == 200, answer.text
    return dict(answer.json()["lease"])


# --- the stream -------------------------------------------------------------------------


def test_the_stream_tells_each_change_of_a_leases_life_and_ends_with_it(
    make_scheduler: Make,
) -> None:
    sched = pool(make_scheduler, PREEMPTION_GRACE_SECONDS="3")
    lease = sched.lease(owner_id="anim", ttl_seconds=600)
    stream = Stream(sched, lease["lease_id"], owner="anim")

    first = stream.wait("active")
    assert stream.status == 200 and stream.content_type.startswith("text/event-stream")
    assert first["lease_id"] == lease["lease_id"] and first["state"] == "active"

    renewed = sched.http.post(
        f"/v1/lease/{lease['lease_id']}/renew",
        json={"ttl_seconds": 900},
        headers={"X-Lease-Owner": "anim"},
    )
    assert renewed.status_code == 200, renewed.text
    heard = stream.wait("renewed")
    assert heard["expires_at"] == renewed.json()["expires_at"] != first["expires_at"]

    live = live_caller(sched)
    preempting = stream.wait("preempting")
    assert preempting["state"] == "preempting" and preempting["preempt_at"] is not None
    assert preempting["preempt_at"] == lookup(sched, lease["lease_id"])["preempt_at"]

    # At its deadline the worker goes: the last event, and the stream ends.
    assert stream.finished(60) == ["active", "renewed", "preempting", "released"]
    ended = stream.events[-1][1]
    assert ended["state"] == "released" and ended["release_reason"] == "preempted", ended
    assert ended["released_at"] is not None
    assert served(live)["owner_id"] == "live-control"

    # A lease already over: one `released`, and the stream ends.
    again = Stream(sched, lease["lease_id"], owner="anim")
    assert again.finished(30) == ["released"]
    assert again.events[0][1]["release_reason"] == "preempted"


def test_a_stream_is_the_owners_alone_and_an_unknown_lease_is_a_404(
    make_scheduler: Make,
) -> None:
    sched = pool(make_scheduler)
    lease = sched.lease(owner_id="anim", ttl_seconds=600)
    path = f"/v1/lease/{lease['lease_id']}/events"
    for headers in ({"X-Lease-Owner": "someone-else"}, {}):
        refused = sched.http.get(path, headers=headers)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"] == "forbidden"
    unknown = sched.http.get("/v1/lease/00000000-0000-4000-8000-000000000000/events")
    assert unknown.status_code == 404, unknown.text
    assert unknown.json()["error"] == "lease_not_found"
    without_secret = HTTP.get(f"{sched.url}{path}", headers={"X-Lease-Owner": "anim"})
    assert without_secret.status_code == 401
    # A lease without an owner is followed without X-Lease-Owner.
    assert sched.release(lease["lease_id"], owner="anim").status_code == 204
    anyones = sched.lease(ttl_seconds=600)
    stream = Stream(sched, anyones["lease_id"])
    stream.wait("active")
    assert sched.release(anyones["lease_id"]).status_code == 204
    assert stream.finished(30) == ["active", "released"]
    assert stream.events[-1][1]["release_reason"] == "explicit"


def test_a_lost_worker_ends_the_stream_with_its_cause(make_scheduler: Make) -> None:
    # The reconciler off: the Docker engine's event stream alone hears the death.
    sched = make_scheduler(RECONCILE_INTERVAL_SECONDS="3600")
    lease = sched.lease(owner_id="me", ttl_seconds=600)
    stream = Stream(sched, lease["lease_id"], owner="me")
    stream.wait("active")
    docker_client().containers.get(lease["provider_token"]).kill()
    assert stream.finished(60) == ["active", "released"]
    ended = stream.events[-1][1]
    assert (ended["release_reason"], ended["lost_cause"], ended["exit_code"]) == (
        "lost",
        "exited",
        137,
    ), ended


def test_a_stream_ends_when_its_caller_hangs_up(make_scheduler: Make) -> None:
    sched = pool(make_scheduler)
    lease = sched.lease(owner_id="anim", ttl_seconds=600)
    url = f"{sched.url}/v1/lease/{lease['lease_id']}/events"
    headers = {"X-Internal-Secret": SECRET, "X-Lease-Owner": "anim"}

    def finished() -> float:
        return sched.metric(
            "scheduler_http_request_duration_seconds_count",
            route="/v1/lease/{lease_id}/events",
            method="GET",
            status="200",
        )

    with httpx.Client(timeout=30) as caller, caller.stream("GET", url, headers=headers) as answer:
        lines = answer.iter_lines()
        assert next(lines) == "event: active"
        assert finished() == 0  # still streaming
    # The caller hung up with the lease still active: the stream's request is over (its
    # task gone), counted when it ended.
    wait_for(lambda: finished() == 1, 60, what="the stream to end with its caller")
    assert lookup(sched, lease["lease_id"])["state"] == "active"


def test_a_drain_ends_the_streams_and_is_not_held_up_by_them(make_scheduler: Make) -> None:
    sched = pool(make_scheduler, SHUTDOWN_GRACE_SECONDS="120")
    lease = sched.lease(owner_id="anim", ttl_seconds=600)
    stream = Stream(sched, lease["lease_id"], owner="anim")
    stream.wait("active")
    assert sched.proc is not None
    sched.proc.send_signal(signal.SIGTERM)
    # The stream ends, and the process exits well within its grace (nothing under way).
    assert stream.ended.wait(60), "the stream outlived the drain"
    wait_for(lambda: sched.proc is not None and sched.proc.poll() is not None, 60, what="exit")
    assert sched.proc.returncode == 0
    assert "still under way after" not in sched.log()
    assert stream.names() == ["active"]


@pytest.mark.timeout(300)
def test_a_stream_on_another_replica_hears_a_preemption_made_by_the_first(
    replicas: Replicas,  # noqa: F811 - the fixture
) -> None:
    first, second = replicas(
        PROVIDERS="static", STATIC_WORKERS=ONE_RENDERER, **CLASSES, **LONG_GRACE
    )
    lease = first.lease(owner_id="anim", ttl_seconds=LONG_TTL)
    stream = Stream(second, lease["lease_id"], owner="anim")
    stream.wait("active")
    live = live_caller(first)
    heard = stream.wait("preempting", 30)
    assert heard["preempt_at"] is not None
    deadline = parse_time(heard["preempt_at"])
    assert datetime.now(UTC) < deadline  # heard during the grace, not after it
    # The victim lets go on the second replica: the first's live caller is served.
    assert second.release(lease["lease_id"], owner="anim").status_code == 204
    assert served(live)["owner_id"] == "live-control"
    assert stream.finished(30) == ["active", "preempting", "released"]
    assert datetime.now(UTC) < deadline


# --- the clients --------------------------------------------------------------------------


def test_the_sync_client_hears_its_preemption_at_once_and_its_release_frees_the_room(
    make_scheduler: Make,
) -> None:
    sched = pool(make_scheduler, **LONG_GRACE)
    notices: list[PreemptNotice] = []
    noticed = threading.Event()
    lost: list[tuple[str, str]] = []

    def on_preempt(notice: PreemptNotice) -> None:
        notices.append(notice)
        noticed.set()

    with SchedulerClient(sched.url, SECRET) as client:
        with client.lease(
            "renderer",
            owner_id="anim",
            ttl_seconds=LONG_TTL,
            on_preempt=on_preempt,
            on_lost=lambda lease_id, reason: lost.append((lease_id, reason)),
        ) as held:
            assert not held.preempting
            live = live_caller(sched)
            assert noticed.wait(30), "no notice of the preemption"
            heard_at = datetime.now(UTC)
            assert held.preempting and held.preempt_at is not None
            # Renewals alone would have heard of it after 100 s: it came long before
            # the worker goes.
            assert heard_at < parse_time(held.preempt_at)
            # The holder finishes at once.
        answered = served(live, 30)
    deadline = parse_time(held.preempt_at)
    assert datetime.now(UTC) < deadline, "the preemptor waited for the grace"
    assert answered["endpoint"] == "http://only:8080"
    [notice] = notices
    assert notice.lease_id == held.lease_id and notice.preempt_at == held.preempt_at
    assert notice.lease.state == "preempting"
    ended = lookup(sched, held.lease_id)
    assert ended["state"] == "released" and ended["release_reason"] == "explicit", ended
    assert lost == [], "its own release was taken for a loss"


def test_the_async_client_hears_its_preemption_at_once_and_its_release_frees_the_room(
    make_scheduler: Make,
) -> None:
    sched = pool(make_scheduler, **LONG_GRACE)

    async def run() -> tuple[list[PreemptNotice], str, str | None, dict[str, Any]]:
        notices: list[PreemptNotice] = []
        noticed = asyncio.Event()

        def on_preempt(notice: PreemptNotice) -> None:
            notices.append(notice)
            noticed.set()

        async with AsyncSchedulerClient(sched.url, SECRET) as client:
            async with client.lease(
                "renderer", owner_id="anim", ttl_seconds=LONG_TTL, on_preempt=on_preempt
            ) as held:
                live = live_caller(sched)
                await asyncio.wait_for(noticed.wait(), 30)
                assert held.preempting and held.preempt_at is not None
                assert datetime.now(UTC) < parse_time(held.preempt_at)
            answered = await asyncio.to_thread(served, live, 30)
        return notices, held.lease_id, held.preempt_at, answered

    notices, lease_id, preempt_at, answered = asyncio.run(run())
    assert preempt_at is not None
    assert datetime.now(UTC) < parse_time(preempt_at), "the preemptor waited for the grace"
    assert answered["owner_id"] == "live-control"
    assert [n.lease_id for n in notices] == [lease_id]
    ended = lookup(sched, lease_id)
    assert ended["state"] == "released" and ended["release_reason"] == "explicit", ended


def test_a_client_that_does_not_listen_hears_nothing_until_its_renewal(
    make_scheduler: Make,
) -> None:
    sched = pool(make_scheduler, **LONG_GRACE)
    noticed = threading.Event()
    with SchedulerClient(sched.url, SECRET) as client:
        with client.lease(
            "renderer",
            owner_id="anim",
            ttl_seconds=LONG_TTL,
            on_preempt=lambda _notice: noticed.set(),
            listen=False,
        ) as held:
            live = live_caller(sched)
            wait_for(
                lambda: lookup(sched, held.lease_id)["state"] == "preempting",
                30,
                what="the preemption",
            )
            # The stream would have told it by now; the renewals (every 100 s) have not.
            assert not noticed.wait(3)
            assert not held.preempting
        # Its release at the block's end still frees the room at once.
        assert served(live, 30)["owner_id"] == "live-control"


def test_a_client_hears_its_lease_end_under_it_through_the_stream(make_scheduler: Make) -> None:
    sched = pool(make_scheduler)
    lost: list[tuple[str, str]] = []
    told = threading.Event()

    def on_lost(lease_id: str, reason: str) -> None:
        lost.append((lease_id, reason))
        told.set()

    with (
        SchedulerClient(sched.url, SECRET) as client,
        client.lease("renderer", owner_id="anim", ttl_seconds=LONG_TTL, on_lost=on_lost) as h,
    ):
        # Someone else lets it go (the operator, say): its holder hears at once.
        assert sched.release(h.lease_id, owner="anim").status_code == 204
        assert told.wait(30)
        assert h.lost and h.lost_reason == "explicit"
    # Heard from the stream: the first renewal was 100 s away.
    assert lost == [(h.lease_id, "explicit")]
    assert h.renewals == 0


def test_a_renewal_refused_as_preempting_still_releases_at_the_blocks_end(
    make_scheduler: Make,
) -> None:
    """Regression: a holder whose renewal heard of the preemption (409 `preempting`) took
    the lease for lost and did not release it, so the preemptor waited out the grace."""
    sched = pool(make_scheduler, **LONG_GRACE)
    notices: list[PreemptNotice] = []
    lost: list[str] = []
    with SchedulerClient(sched.url, SECRET) as client:
        # Not listening, with a short TTL: a renewal every 2 s hears of it (and the
        # lease would end at its expiry soon after, not by its release, without the fix).
        with client.lease(
            "renderer",
            owner_id="anim",
            ttl_seconds=6,
            listen=False,
            on_preempt=notices.append,
            on_lost=lambda _lease_id, reason: lost.append(reason),
        ) as held:
            live = live_caller(sched)
            wait_for(lambda: lost, 30, what="a renewal refused")
            assert held.lost and held.preempting and lost == ["preempted"]
        answered = served(live, 30)
    assert answered["owner_id"] == "live-control"
    [notice] = notices
    assert notice.preempt_at is not None and datetime.now(UTC) < parse_time(notice.preempt_at)
    ended = lookup(sched, held.lease_id)
    assert ended["state"] == "released" and ended["release_reason"] == "explicit", ended


def test_the_client_listens_again_after_its_scheduler_restarts(make_scheduler: Make) -> None:
    sched = pool(make_scheduler, **LONG_GRACE)
    noticed = threading.Event()
    with SchedulerClient(sched.url, SECRET) as client:
        with client.lease(
            "renderer",
            owner_id="anim",
            ttl_seconds=LONG_TTL,
            on_preempt=lambda _notice: noticed.set(),
        ) as held:
            # The scheduler drains (its stream ends) and comes back on the same address
            # and store: the client opens the stream again.
            sched.stop()
            sched.start()
            live = live_caller(sched)
            assert noticed.wait(60), "no notice after the restart"
            assert held.preempting
        assert served(live, 30)["owner_id"] == "live-control"
