"""The Python client against the real service over HTTP (the static provider: no Docker
workers needed, except for the one provision failure). The retries of an idempotent
acquire meet a scheduler that is not up yet, and a real PostgreSQL stopped and started
again (a private server: stopping it disturbs no other test)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator

import pytest

from openalice_scheduler import server
from openalice_scheduler.client import (
    AsyncSchedulerClient,
    LeaseLost,
    RetryPolicy,
    SchedulerClient,
    SchedulerUnreachable,
)
from openalice_scheduler.client.aio import _Block
from openalice_scheduler.client.core import LIMITS
from openalice_scheduler.errors import (
    Forbidden,
    InvalidRequest,
    LeaseNotFound,
    NoProviderAvailable,
    ProvisionFailed,
    QuotaExceeded,
    SchedulerError,
    Unauthorized,
)
from openalice_scheduler.models import Lease, LeaseState, ReleaseReason
from tests.harness import SECRET, Scheduler, free_port, on_static, wait_for
from tests.postgres import PrivatePostgres

STATIC_WORKERS = "renderer=http://a:8080,http://b:8080;anim=http://c:9000"
ENV_VALUE = "env-value-" + uuid.uuid4().hex


@pytest.fixture
def static(make_scheduler: Callable[..., Scheduler]) -> Scheduler:
    # A one-second sweep, so that a lease nobody renews really ends within the tests.
    return on_static(make_scheduler, STATIC_WORKERS, SWEEP_INTERVAL_SECONDS="1")


@pytest.fixture
def client(static: Scheduler) -> Iterator[SchedulerClient]:
    with SchedulerClient(static.url, SECRET) as c:
        yield c


def test_client_round_trip(static: Scheduler, client: SchedulerClient) -> None:
    lease = client.acquire(
        "renderer", ttl_seconds=600, owner_id="me", correlation_id="job-1", env={"TOKEN": ENV_VALUE}
    )
    assert lease.endpoint in ("http://a:8080", "http://b:8080")
    assert (lease.owner_id, lease.correlation_id, lease.state) == ("me", "job-1", LeaseState.active)
    assert client.get(lease.lease_id) == lease
    assert [x.lease_id for x in client.list()] == [lease.lease_id]
    assert [x.lease_id for x in client.list(owner_id="me", kind="renderer")] == [lease.lease_id]
    assert client.list(owner_id="someone-else") == []
    assert client.list(state=["released", "failed"]) == []

    # Without a TTL, the lease's own (600 s) counts again from now.
    assert client.renew(lease).expires_at > lease.expires_at
    renewed = client.renew(lease, ttl_seconds=1200)
    assert renewed.expires_at > lease.expires_at
    [view] = client.providers()
    assert (view.name, view.healthy, view.in_use) == ("static", True, 1)
    assert client.health().status == "ok"

    # The owner is required on release, and the client sends it without being told.
    assert static.release(lease.lease_id).status_code == 403
    client.release(lease.lease_id)
    gone = client.get(lease.lease_id)
    assert (gone.state, gone.release_reason) == (LeaseState.released, ReleaseReason.explicit)
    assert client.list() == []
    assert [x.lease_id for x in client.list(state=LeaseState.released)] == [lease.lease_id]
    assert ENV_VALUE not in repr(client) and SECRET not in repr(client)


def test_errors_are_typed_by_code(static: Scheduler, client: SchedulerClient) -> None:
    with (
        SchedulerClient(static.url, "wrong-secret") as stranger,
        pytest.raises(Unauthorized) as unauthorized,
    ):
        stranger.list()
    assert unauthorized.value.status == 401
    assert SECRET not in str(unauthorized.value)

    with pytest.raises(LeaseNotFound) as not_found:
        client.get(str(uuid.uuid4()))
    assert (not_found.value.status, not_found.value.code) == (404, "lease_not_found")

    owned = client.acquire("renderer", owner_id="me")
    with SchedulerClient(static.url, SECRET) as other:
        with pytest.raises(Forbidden) as forbidden:
            other.release(owned.lease_id)
        assert forbidden.value.status == 403
        other.release(owned.lease_id, owner="me")
    with pytest.raises(LeaseNotFound):
        client.renew(owned)

    # Refused by the service, and by the client before sending: the same class.
    with pytest.raises(InvalidRequest) as bad_filter:
        client.list(state="bogus")
    assert (bad_filter.value.status, bad_filter.value.details["field"]) == (422, "state.0")
    with pytest.raises(InvalidRequest) as bad_ttl:
        client.acquire("renderer", ttl_seconds=0)
    assert bad_ttl.value.details["field"] == "ttl_seconds"
    with pytest.raises(InvalidRequest) as bad_env:
        client.acquire("renderer", env={"bad-key": ENV_VALUE})
    assert "bad-key" in str(bad_env.value)
    assert ENV_VALUE not in "".join(traceback.format_exception(bad_env.value))
    with pytest.raises(InvalidRequest) as no_id:
        client.get("")
    assert no_id.value.details["field"] == "lease_id"

    client.acquire("anim")
    with pytest.raises(NoProviderAvailable) as no_capacity:
        client.acquire("anim")
    assert no_capacity.value.status == 503
    assert no_capacity.value.retry_after is not None and 1 <= no_capacity.value.retry_after <= 300
    assert "static" in no_capacity.value.details["reasons"]

    with (
        SchedulerClient(f"http://127.0.0.1:{free_port()}", SECRET) as nowhere,
        pytest.raises(SchedulerError) as unreachable,
    ):
        nowhere.providers()
    assert isinstance(unreachable.value, SchedulerUnreachable)


def test_the_client_refuses_strings_no_lease_can_carry(
    static: Scheduler, client: SchedulerClient
) -> None:
    # Before the rule, the first of these made a lease that release() could never give
    # back: httpx raised UnicodeEncodeError on the X-Lease-Owner header.
    for bad in ("é", "\N{SLIGHTLY SMILING FACE}", "a\nb", "a\x00b", "anim service", ""):
        with pytest.raises(InvalidRequest) as refused:
            client.acquire("renderer", owner_id=bad)
        assert refused.value.details["field"] == "owner_id", repr(bad)
    for field in ("correlation_id", "region"):
        with pytest.raises(InvalidRequest) as refused:
            client.acquire("renderer", **{field: "é"})  # type: ignore[arg-type]
        assert refused.value.details["field"] == field
    assert static.leases() == []

    lease = client.acquire("renderer", owner_id="me")
    for bad in ("é", "\N{SLIGHTLY SMILING FACE}", "a\nb", ""):
        with pytest.raises(InvalidRequest) as release:
            client.release(lease, owner=bad)
        assert release.value.details["field"] == "owner", repr(bad)
        with pytest.raises(InvalidRequest):
            client.renew(lease, owner=bad)
    with pytest.raises(InvalidRequest) as listing:
        client.list(owner_id="é")
    assert listing.value.details["field"] == "owner_id"
    assert client.get(lease).state == LeaseState.active
    client.release(lease)  # with the owner it was acquired with
    assert client.get(lease).state == LeaseState.released


async def test_the_async_client_refuses_an_owner_that_cannot_be_a_header(
    static: Scheduler,
) -> None:
    async with AsyncSchedulerClient(static.url, SECRET) as client:
        lease = await client.acquire("renderer", owner_id="me")
        with pytest.raises(InvalidRequest):
            await client.release(lease, owner="é")
        with pytest.raises(InvalidRequest):
            await client.renew(lease, owner="a\r\nX-Injected: 1")
        await client.release(lease)


def test_quota_is_429(make_scheduler: Callable[..., Scheduler]) -> None:
    sched = make_scheduler(
        PROVIDERS="static", STATIC_WORKERS=STATIC_WORKERS, MAX_LEASES_PER_OWNER="1"
    )
    with SchedulerClient(sched.url, SECRET) as client:
        client.acquire("renderer", owner_id="greedy")
        with pytest.raises(QuotaExceeded) as quota:
            client.acquire("renderer", owner_id="greedy")
        assert (quota.value.status, quota.value.details["limit"]) == (429, 1)
        assert client.acquire("renderer", owner_id="modest").owner_id == "modest"


def test_provision_failure_is_502(make_scheduler: Callable[..., Scheduler]) -> None:
    sched = make_scheduler(PROVIDERS="local-docker", RENDERER_IMAGE="openalice-missing:never")
    with SchedulerClient(sched.url, SECRET) as client, pytest.raises(ProvisionFailed) as failed:
        client.acquire("renderer")
    assert failed.value.status == 502
    assert "openalice-missing:never" in failed.value.details["failures"]["local-docker"]


def test_lease_context_renews_in_the_background(static: Scheduler, client: SchedulerClient) -> None:
    # The control: the same TTL, not renewed, ends within the hold.
    unrenewed = client.acquire("renderer", ttl_seconds=3)
    with client.lease("renderer", ttl_seconds=3, owner_id="me") as held:
        first_expiry = held.expires_at
        # Renewed every second (a third of the TTL): five renewals take five seconds at
        # least, past the 3 s TTL plus a sweep (1 s) however slow the machine; and the
        # control has been swept as expired meanwhile.
        wait_for(
            lambda: (
                held.renewals >= 5
                and static.http.get(f"/v1/lease/{unrenewed.lease_id}").json()["state"] == "released"
            ),
            60,
            0.2,
            what="five renewals, and the unrenewed control expired",
        )
        now = static.http.get(f"/v1/lease/{held.lease_id}").json()
        assert now["state"] == "active"
        assert now["expires_at"] > first_expiry
        assert held.renewals >= 2 and not held.lost and held.error is None
    assert client.get(unrenewed).release_reason == ReleaseReason.expired
    after = client.get(held.lease_id)
    assert (after.state, after.release_reason) == (LeaseState.released, ReleaseReason.explicit)


def test_lease_context_releases_when_the_block_raises(client: SchedulerClient) -> None:
    with (
        pytest.raises(RuntimeError, match="render crashed"),
        client.lease("anim", ttl_seconds=600, owner_id="me") as held,
    ):
        assert client.get(held.lease_id).state == LeaseState.active
        raise RuntimeError("render crashed")
    assert client.get(held.lease_id).release_reason == ReleaseReason.explicit
    # The one anim endpoint is free again.
    assert client.acquire("anim").endpoint == "http://c:9000"


async def test_async_client(static: Scheduler) -> None:
    async with AsyncSchedulerClient(static.url, SECRET) as client:
        lease = await client.acquire("renderer", ttl_seconds=600, owner_id="me")
        assert (await client.get(lease.lease_id)).endpoint == lease.endpoint
        assert [x.lease_id for x in await client.list(owner_id="me")] == [lease.lease_id]
        assert (await client.renew(lease, ttl_seconds=900)).expires_at > lease.expires_at
        assert (await client.providers())[0].in_use == 1
        await client.release(lease)
        with pytest.raises(LeaseNotFound):
            await client.release(lease)

        async with client.lease("renderer", ttl_seconds=3, owner_id="me") as held:
            first_expiry = held.expires_at
            # Past the 3 s TTL plus a sweep (1 s), counted in renewals (one a second):
            # polled off the loop, where the renewal task runs.
            await asyncio.to_thread(
                wait_for, lambda: held.renewals >= 5, 60, 0.2, what="five renewals"
            )
            now = static.http.get(f"/v1/lease/{held.lease_id}").json()
            assert now["state"] == "active" and now["expires_at"] > first_expiry
            assert held.renewals >= 1
        assert (await client.get(held.lease_id)).release_reason == ReleaseReason.explicit

        with pytest.raises(RuntimeError, match="boom"):
            async with client.lease("anim", ttl_seconds=600) as failing:
                raise RuntimeError("boom")
        assert (await client.get(failing.lease_id)).state == LeaseState.released

        await client.acquire("anim")
        with pytest.raises(NoProviderAvailable) as no_capacity:
            await client.acquire("anim")
        assert no_capacity.value.retry_after is not None


# --- retries of an idempotent acquire ----------------------------------------------------

PATIENT = RetryPolicy(attempts=200, timeout=120)  # the machine may be slow to start one
QUICK = RetryPolicy(attempts=3, wait_initial=0.01, wait_max=0.05, wait_jitter=0)


def retry_records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == "openalice_scheduler.client.retrying"
    ]


def test_an_idempotent_acquire_waits_for_a_scheduler_that_comes_up(
    make_scheduler: Callable[..., Scheduler], caplog: pytest.LogCaptureFixture
) -> None:
    sched = make_scheduler(start=False, PROVIDERS="static", STATIC_WORKERS=STATIC_WORKERS)
    # Nothing listens on its port yet; the scheduler starts a second after the acquire.
    starter = threading.Timer(1.0, sched.start, kwargs={"wait": False})
    starter.start()
    try:
        with SchedulerClient(sched.url, SECRET, retry=PATIENT) as client:
            lease = client.acquire("renderer", owner_id="anim", correlation_id="job-7")
            assert lease.state == LeaseState.active
            # Exactly one lease for the pair; asking again returns it.
            mine = [x for x in sched.leases() if x["correlation_id"] == "job-7"]
            assert [x["lease_id"] for x in mine] == [lease.lease_id]
            assert (
                client.acquire("renderer", owner_id="anim", correlation_id="job-7").lease_id
                == lease.lease_id
            )
    finally:
        starter.join()
    retried = retry_records(caplog)
    assert retried and all("scheduler_unreachable" in m and "job-7" in m for m in retried)


async def test_retries_are_bounded_and_only_for_idempotent_acquires(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    with SchedulerClient(nowhere, SECRET, retry=QUICK) as client:
        with pytest.raises(SchedulerUnreachable):
            client.acquire("renderer", owner_id="o", correlation_id="c")
        assert [m.split(" after ")[0].rsplit(": ", 1)[1] for m in retry_records(caplog)] == [
            "attempt 2 of at most 3",
            "attempt 3 of at most 3",
        ]
        caplog.clear()
        # Without the pair a repeat could make a second worker: sent once.
        for unsafe in ({"correlation_id": "c"}, {"owner_id": "o"}, {}):
            with pytest.raises(SchedulerUnreachable):
                client.acquire("renderer", **unsafe)
        assert retry_records(caplog) == []
    with SchedulerClient(nowhere, SECRET, retry=None) as never:
        with pytest.raises(SchedulerUnreachable):
            never.acquire("renderer", owner_id="o", correlation_id="c")
        assert retry_records(caplog) == []

    # Bounded in time too: many attempts allowed, one second to make them in.
    brief = RetryPolicy(
        attempts=10_000, timeout=1.0, wait_initial=0.05, wait_max=0.1, wait_jitter=0
    )
    async with AsyncSchedulerClient(nowhere, SECRET, retry=brief) as aclient:
        with pytest.raises(SchedulerUnreachable):
            await aclient.acquire("anim", owner_id="o", correlation_id="c")
    assert 2 <= len(retry_records(caplog)) < 1000

    with pytest.raises(ValueError, match="attempts"):
        RetryPolicy(attempts=0)


def test_no_capacity_is_not_retried(
    static: Scheduler, client: SchedulerClient, caplog: pytest.LogCaptureFixture
) -> None:
    client.acquire("anim", owner_id="a", correlation_id="first")
    with pytest.raises(NoProviderAvailable):
        client.acquire("anim", owner_id="a", correlation_id="second")
    assert retry_records(caplog) == []


def test_an_idempotent_acquire_is_retried_while_the_store_is_unavailable(
    make_scheduler: Callable[..., Scheduler],
    private_pg: PrivatePostgres,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sched = make_scheduler(
        PROVIDERS="static", STATIC_WORKERS=STATIC_WORKERS, DATABASE_URL=private_pg.url
    )
    private_pg.stop()
    try:
        refused = sched.acquire(owner_id="probe", correlation_id="probe")
        assert (refused.status_code, refused.json()["error"]) == (503, "store_unavailable")

        outcome: dict[str, object] = {}

        def acquire() -> None:
            with SchedulerClient(sched.url, SECRET, retry=PATIENT) as client:
                try:
                    outcome["lease"] = client.acquire(
                        "renderer", owner_id="anim", correlation_id="job-9"
                    )
                except SchedulerError as exc:
                    outcome["error"] = exc

        caller = threading.Thread(target=acquire, daemon=True)
        caller.start()
        wait_for(
            lambda: any("store_unavailable" in m for m in retry_records(caplog)),
            60,
            what="the acquire to be retried after a 503 store_unavailable",
        )
    finally:
        private_pg.start()
    caller.join(120)
    lease = outcome.get("lease")
    assert lease is not None, outcome
    mine = [x for x in sched.leases() if x["correlation_id"] == "job-9"]
    assert [x["lease_id"] for x in mine] == [lease.lease_id]  # type: ignore[attr-defined]


# --- a held lease that ends while held ---------------------------------------------------


def test_on_lost_hears_of_a_lease_released_elsewhere(
    static: Scheduler, client: SchedulerClient
) -> None:
    lost: list[tuple[str, str]] = []
    told = threading.Event()

    def on_lost(lease_id: str, reason: str) -> None:
        lost.append((lease_id, reason))
        told.set()

    with client.lease("renderer", ttl_seconds=3, owner_id="me", on_lost=on_lost) as held:
        with SchedulerClient(static.url, SECRET) as other:
            other.release(held.lease_id, owner="me")
        assert told.wait(30), "on_lost was not called"
        assert held.lost and held.lost_reason == "explicit"
        assert held.lease.state == LeaseState.released
    # Called once; leaving the block neither raises nor releases again.
    assert lost == [(held.lease_id, "explicit")]
    assert client.get(held.lease_id).release_reason == ReleaseReason.explicit


async def test_the_async_block_is_cancelled_when_its_lease_is_lost(static: Scheduler) -> None:
    lost: list[tuple[str, str]] = []
    seen: list[str] = []
    async with (
        AsyncSchedulerClient(static.url, SECRET) as client,
        AsyncSchedulerClient(static.url, SECRET) as other,
    ):
        with pytest.raises(LeaseLost) as ended:
            async with client.lease(
                "renderer",
                ttl_seconds=3,
                owner_id="me",
                on_lost=lambda *args: lost.append(args),
                cancel_on_lost=True,
            ) as held:
                try:
                    # The lease's event stream may cancel the block while the release is
                    # still being answered: the release is inside the block's wait.
                    await other.release(held.lease_id, owner="me")
                    # Until the block is cancelled; a minute without it fails the test.
                    await asyncio.wait_for(asyncio.Event().wait(), 60)
                except asyncio.CancelledError:
                    seen.append("cancelled")
                    raise
        assert seen == ["cancelled"]
        assert (ended.value.lease_id, ended.value.reason) == (held.lease_id, "explicit")
        assert isinstance(ended.value, LeaseNotFound)
        assert lost == [(held.lease_id, "explicit")]
        # The task itself was not left cancelled: it goes on after the block.
        current = asyncio.current_task()
        assert current is not None and current.cancelling() == 0
        assert (await client.get(held.lease_id)).state == LeaseState.released  # awaits fine

        # Not asked to cancel: the block runs to its end, and on_lost still hears of it.
        told = asyncio.Event()
        async with client.lease(
            "renderer", ttl_seconds=3, owner_id="me", on_lost=lambda *args: told.set()
        ) as kept:
            await other.release(kept.lease_id, owner="me")
            await asyncio.wait_for(told.wait(), 30)
            seen.append("block ended")
        assert seen == ["cancelled", "block ended"] and kept.lost

        # A block that swallows the cancellation ends as it chose; the task is left with
        # no cancellation pending, so a later asyncio.timeout() in it still works.
        async with client.lease(
            "renderer", ttl_seconds=3, owner_id="me", cancel_on_lost=True
        ) as stubborn:
            try:  # the release, too, may be where the cancellation lands
                await other.release(stubborn.lease_id, owner="me")
                await asyncio.wait_for(asyncio.Event().wait(), 60)  # until cancelled
            except asyncio.CancelledError:
                seen.append("swallowed")
        assert seen[-1] == "swallowed" and current.cancelling() == 0
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                # Never set: only the timeout ends it (else the test's own timeout does).
                await asyncio.Event().wait()


async def test_a_lease_found_lost_twice_cancels_its_block_once() -> None:
    """The lease's event stream and its renewer may both find it gone (a release heard
    while a renewal is refused): the block is cancelled once, and that one is taken back
    as the block ends, so the task goes on with no cancellation pending. Seen in a run:
    `cancelling() == 1` after a block that swallowed the cancellation."""
    block = _Block(cancel_on_lost=True)
    task = asyncio.current_task()
    assert task is not None
    block.cancel()  # the event stream hears the release
    block.cancel()  # the renewer is refused
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()  # where the cancellation lands; the block swallows it
    block.running = False
    assert block.took_back_its_cancel()  # ours, and the only one
    assert task.cancelling() == 0
    with pytest.raises(TimeoutError):  # a later timeout in the task still works
        async with asyncio.timeout(0.05):
            await asyncio.Event().wait()


def test_a_failing_on_lost_is_logged(
    static: Scheduler, client: SchedulerClient, caplog: pytest.LogCaptureFixture
) -> None:
    def on_lost(lease_id: str, reason: str) -> None:
        raise RuntimeError("callback broke")

    with (
        caplog.at_level(logging.ERROR),
        client.lease("anim", ttl_seconds=3, owner_id="me", on_lost=on_lost) as held,
    ):
        static.release(held.lease_id, owner="me")
        wait_for(lambda: held.lost_reason is not None, 30, what="the loss to be noticed")
        wait_for(
            lambda: any("on_lost" in r.getMessage() for r in caplog.records),
            10,
            what="the callback's failure to be logged",
        )
    assert client.get(held.lease_id).state == LeaseState.released


def test_a_held_lease_that_is_preempted_stops_renewing_and_hears_why(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = on_static(
        make_scheduler,
        PRIORITY_CLASSES="live=100:preempts,default=50,anim=10:preemptible",
        UNLISTED_OWNER_MAX_CLASS="live",
        PREEMPTION_GRACE_SECONDS="600",
    )
    told = threading.Event()
    lost: list[tuple[str, str]] = []
    answer: list[Lease | BaseException] = []

    def on_lost(lease_id: str, reason: str) -> None:
        lost.append((lease_id, reason))
        told.set()

    with (
        SchedulerClient(sched.url, SECRET) as client,
        SchedulerClient(sched.url, SECRET, timeout=120) as live,
    ):

        def acquire() -> None:
            try:
                answer.append(live.acquire("renderer", priority_class="live", wait_seconds=60))
            except BaseException as exc:  # noqa: BLE001 - shown by the test
                answer.append(exc)

        caller = threading.Thread(target=acquire, daemon=True)
        # Not listening to the lease's events: the renewal hears of the preemption (the
        # listener's `on_preempt` is tests/test_lease_events.py's).
        with client.lease(
            "renderer",
            ttl_seconds=6,
            owner_id="me",
            priority_class="anim",
            on_lost=on_lost,
            listen=False,
        ) as held:
            assert held.lease.priority_class == "anim"
            caller.start()
            assert told.wait(30), "on_lost was not called"
            assert held.lost and held.lost_reason == "preempted"
            assert held.lease.state == LeaseState.preempting and held.lease.preempt_at
            asked = sched.log().count(f"/v1/lease/{held.lease_id}/renew")
            # None is tried any more: the renewal thread has ended (no thread is left
            # to send one), and the scheduler heard no renewal since.
            renewer = f"renew-lease-{held.lease_id[:8]}"
            wait_for(
                lambda: not any(t.name == renewer for t in threading.enumerate()),
                30,
                what="the renewal thread to end",
            )
            assert sched.log().count(f"/v1/lease/{held.lease_id}/renew") == asked
        # Leaving the block releases the lease (unless its TTL, no longer renewed, ran
        # out first): the preemptor is served.
        caller.join(60)
    [lease] = answer
    assert isinstance(lease, Lease) and lease.priority_class == "live", lease
    assert lost == [(held.lease_id, "preempted")]


def test_a_kept_alive_connection_is_let_go_well_before_the_service_closes_it() -> None:
    """A request sent on a connection at the moment the service closes it for idleness is
    lost without an answer ("Server disconnected"; an acquire is sent once). httpx keeps
    a connection 5 s by default, the service's own idle timeout, so a caller pausing 5 s
    between calls met that race (seen once in the image's replica test): the client and
    the guard give a connection up with a margin of seconds, not milliseconds."""
    served = server.http_options("h11")["timeout_keep_alive"]
    assert LIMITS.keepalive_expiry is not None
    assert served - LIMITS.keepalive_expiry >= 2, (served, LIMITS.keepalive_expiry)
