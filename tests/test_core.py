"""The core's rules about time, tested with its clock moved instead of sleeping, and its
table of states: the service in this process over a real store and the static provider
(whose workers already run), or a real Docker engine where a rule is about making or
destroying a worker (a release's retries, the warm pool's target, idle time and backoff)."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.trace import NoOpTracer

from openalice_scheduler.config import PoolEntry, Settings
from openalice_scheduler.errors import (
    LeaseNotFound,
    NoProviderAvailable,
    ReleaseFailed,
    WorkerLost,
)
from openalice_scheduler.handoff import HandOff
from openalice_scheduler.lifecycle import LeaseService, states
from openalice_scheduler.lifecycle.admission import Priorities
from openalice_scheduler.lifecycle.line import LINE_TIMEOUT_S
from openalice_scheduler.lifecycle.policy import OrderedFirstAvailable
from openalice_scheduler.lifecycle.pooling import Pool
from openalice_scheduler.lifecycle.states import STATE_SETS
from openalice_scheduler.loops import AdmissionLoop
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.models import (
    GpuClass,
    LeaseRequest,
    LeaseState,
    LostCause,
    ReleaseReason,
    WorkerKind,
)
from openalice_scheduler.priorities import parse_priority_classes
from openalice_scheduler.providers import WorkerDeath, WorkerEnded
from openalice_scheduler.providers.docker import LocalDockerProvider
from openalice_scheduler.providers.probe import ReadyProbe
from openalice_scheduler.providers.static import StaticProvider
from openalice_scheduler.store import LeaseRecord, LeaseStore, open_store, to_us
from tests.dockerproxy import DockerProxy
from tests.harness import SECRET, WORKER_IMAGE, database_url, remove_instance


class Clock:
    """The service's one clock (lifecycle/clock.py), moved by the test: wall time and
    monotonic time go forward together."""

    def __init__(self) -> None:
        self.wall = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
        self.seconds = 1000.0

    def now(self) -> datetime:
        return self.wall

    def monotonic(self) -> float:
        return self.seconds

    def move(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.seconds += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


def on_one_endpoint(store: LeaseStore, clock: Clock, **options: Any) -> LeaseService:
    """The service over `store` on the test's clock, its one provider a static pool of
    one renderer endpoint; `options` are LeaseService's own (priorities, say)."""
    return LeaseService(
        store,
        [StaticProvider("renderer=http://only:8080")],
        OrderedFirstAvailable(),
        Metrics(),
        NoOpTracer(),
        clock=clock,
        **options,
    )


@pytest.fixture
def service(store: LeaseStore, clock: Clock) -> LeaseService:
    """The service on one endpoint over a fresh store: once on SQLite, once on
    PostgreSQL (the `store` fixture)."""
    return on_one_endpoint(store, clock)


async def test_a_lease_expires_when_the_clock_reaches_its_expiry(
    service: LeaseService, clock: Clock
) -> None:
    lease = await service.acquire(LeaseRequest(kind=WorkerKind.renderer, ttl_seconds=60))
    clock.move(59.999)
    assert await service.release_due() == 0
    assert (await service.get(lease.lease_id)).state == LeaseState.active
    # Its endpoint is held: the next caller is refused.
    with pytest.raises(NoProviderAvailable):
        await service.acquire(LeaseRequest(kind=WorkerKind.renderer))

    clock.move(0.001)
    assert await service.release_due() == 1
    ended = await service.get(lease.lease_id)
    assert (ended.state, ended.release_reason) == (LeaseState.released, ReleaseReason.expired)
    assert ended.released_at == ended.expires_at
    # Released once: a second pass finds nothing, and the endpoint serves the next caller.
    assert await service.release_due() == 0
    assert (await service.acquire(LeaseRequest(kind=WorkerKind.renderer))).endpoint == (
        "http://only:8080"
    )


async def test_a_renewal_counts_from_now_and_never_revives_an_expired_lease(
    service: LeaseService, clock: Clock
) -> None:
    lease = await service.acquire(LeaseRequest(kind=WorkerKind.renderer, ttl_seconds=60))
    clock.move(50)
    renewed = await service.renew(lease.lease_id, None, 120)
    assert renewed.expires_at - lease.expires_at == 110 * 1_000_000
    clock.move(119)
    assert await service.release_due() == 0  # 1 s left

    clock.move(2)
    with pytest.raises(LeaseNotFound, match="expired"):
        await service.renew(lease.lease_id, None, 600)
    # The sweeper, not the renewal, ends it.
    assert await service.release_due() == 1
    assert (await service.get(lease.lease_id)).release_reason == ReleaseReason.expired


def test_every_state_is_reached_and_every_lease_can_end() -> None:
    reached = {move.target for move in states.MOVES}
    assert reached == set(LeaseState)
    assert {LeaseState.released, LeaseState.failed} == states.FINAL
    # From wherever a lease lives, some moves end it: no state it could be stuck in.
    for start in set(LeaseState) - states.FINAL:
        seen, frontier = {start}, [start]
        while frontier:
            here = frontier.pop()
            for source, target in states.TRANSITIONS:
                if source == here and target not in seen:
                    seen.add(target)
                    frontier.append(target)
        assert seen & states.FINAL, f"{start} cannot end"


async def test_a_death_heard_twice_ends_the_lease_once_and_after_its_expiry_as_expired(
    service: LeaseService, clock: Clock
) -> None:
    provider = service.providers[0]
    death = WorkerEnded(None, "http://only:8080", WorkerDeath(LostCause.unknown, None, "gone"))
    lease = await service.acquire(LeaseRequest(kind=WorkerKind.renderer, ttl_seconds=60))
    # Heard twice (two replicas, or the stream and a listing): ended once.
    assert await service.worker_ended(provider, death) is True
    assert await service.worker_ended(provider, death) is False
    ended = await service.get(lease.lease_id)
    assert (ended.state, ended.release_reason, ended.lost_cause) == (
        LeaseState.released,
        ReleaseReason.lost,
        "unknown",
    )
    with pytest.raises(WorkerLost, match="unknown"):
        await service.renew(lease.lease_id, None, None)
    # Its room is free at once; a death heard once the lease has expired is that expiry.
    again = await service.acquire(LeaseRequest(kind=WorkerKind.renderer, ttl_seconds=60))
    clock.move(60)
    assert await service.worker_ended(provider, death) is True
    late = await service.get(again.lease_id)
    assert (late.release_reason, late.lost_cause) == (ReleaseReason.expired, None)


async def test_a_preempted_lease_runs_its_grace_on_the_moved_clock_then_goes(
    tmp_path: Path, clock: Clock
) -> None:
    with database_url("sqlite", tmp_path) as url:
        store = open_store(url, states=STATE_SETS)
        await store.migrate()
        service = on_one_endpoint(
            store,
            clock,
            priorities=Priorities(
                parse_priority_classes("live=100:preempts,default=50:preemptible"),
                unlisted="live",
            ),
            preemption_grace=30,
        )
        # The line's decisions are the admission loop's (it runs on one replica).
        admission = AdmissionLoop(service, LINE_TIMEOUT_S)
        admission.start()
        victim = await service.acquire(LeaseRequest(kind=WorkerKind.renderer, ttl_seconds=600))
        # A live caller waits for the one endpoint: the victim is told, and goes after its
        # grace, counted on the service's clock.
        waiting = asyncio.create_task(
            service.acquire(
                LeaseRequest(kind=WorkerKind.renderer, priority_class="live", wait_seconds=60)
            )
        )
        preempting = await _until(lambda: service.get(victim.lease_id), "preempting")
        assert preempting.preempt_at == clock_us(clock) + 30_000_000
        clock.move(29.999)
        assert await service.release_due() == 0
        clock.move(0.001)
        assert await service.release_due() == 1
        ended = await service.get(victim.lease_id)
        assert ended.release_reason == ReleaseReason.preempted
        served = await asyncio.wait_for(waiting, 30)
        assert served.priority_class == "live" and served.endpoint == "http://only:8080"
        await admission.stop()
        await store.close()


@dataclass
class OnDocker:
    service: LeaseService
    cut: DockerProxy  # the engine as the service reaches it; cut off by the test


@contextlib.asynccontextmanager
async def on_docker(
    tmp_path: Path, clock: Clock, image: str = WORKER_IMAGE, **settings: Any
) -> AsyncIterator[OnDocker]:
    """The service on the test's clock over a real Docker engine, reached through a
    proxy the test can cut off; its workers of `image`, `settings` its other settings.
    Everything it made is removed."""
    where = Path(tempfile.mkdtemp(prefix="oa-cut-", dir="/tmp"))
    instance = f"t-{uuid.uuid4().hex[:10]}"
    with DockerProxy(where / "docker.sock").start() as cut:
        settings = Settings(  # type: ignore[call-arg]
            internal_secret=SECRET,
            scheduler_instance=instance,
            docker_network=f"oa-{instance}",
            docker_host=cut.url,
            renderer_image=image,
            anim_image=image,
            local_gpu_devices="",
            **settings,
        )
        store = open_store(f"sqlite:///{tmp_path / f'{instance}.db'}", states=STATE_SETS)
        await store.migrate()
        provider = LocalDockerProvider(settings)
        service = LeaseService(
            store,
            [provider],
            OrderedFirstAvailable(),
            Metrics(),
            NoOpTracer(),
            clock=clock,
            probe=ReadyProbe.from_settings(settings),  # a worker is made once it answers
        )
        try:
            yield OnDocker(service, cut)
        finally:
            cut.start()
            await provider.close()
            await store.close()
            remove_instance(instance, f"oa-{instance}")


async def test_a_failed_release_is_retried_after_1_2_4_s_on_the_moved_clock(
    tmp_path: Path, clock: Clock
) -> None:
    # The engine cut off: the release cannot be confirmed, and is retried after 1, 2,
    # 4 … s (at most 30), on the service's clock.
    async with on_docker(tmp_path, clock) as docker:
        service, cut = docker.service, docker.cut
        lease = await service.acquire(LeaseRequest(kind=WorkerKind.renderer))
        cut.stop()
        with pytest.raises(ReleaseFailed):
            await service.release(lease.lease_id, None)
        for wait in (1, 2, 4):
            record = await service.get(lease.lease_id)
            assert record.next_attempt_at == clock_us(clock) + wait * 1_000_000
            clock.move(wait - 0.001)
            assert await service.release_due() == 0  # not due yet
            clock.move(0.001)
            assert await service.release_due() == 1  # tried, and failed again
        cut.start()
        clock.move(8)
        assert await service.release_due() == 1
        assert (await service.get(lease.lease_id)).state == LeaseState.released


def open_pool(service: LeaseService, target: int, max_idle_seconds: float) -> Pool:
    """The service's warm pool of `target` idle renderers (no GPU)."""
    kind, gpu = WorkerKind.renderer.value, GpuClass.none.value
    return service.open_pool(
        {(kind, gpu): PoolEntry(kind, gpu, min=target, max=target)},
        HandOff("/lease", 5),
        max_idle_seconds=max_idle_seconds,
        idle_gauge=Metrics().pool_idle,
    )


async def test_a_pool_keeps_its_target_and_replaces_an_idle_worker_at_its_time(
    tmp_path: Path, clock: Clock
) -> None:
    """Filled to its target and no further; an idle worker is replaced once it has been
    idle WARM_POOL_MAX_IDLE_SECONDS on the service's clock, not a moment before."""
    async with on_docker(tmp_path, clock) as docker:
        pool = open_pool(docker.service, target=1, max_idle_seconds=60)
        try:
            assert await pool.refill() == {"recycled": 0, "warmed": 1}
            [first] = await pool.store.idle()
            assert await pool.refill() == {"recycled": 0, "warmed": 0}  # its target met

            clock.move(59.999)
            assert await pool.refill() == {"recycled": 0, "warmed": 0}
            clock.move(0.001)
            assert await pool.refill() == {"recycled": 1, "warmed": 1}
            [second] = await pool.store.idle()
            assert second.lease_id != first.lease_id
            assert (await docker.service.store.get(first.lease_id)).state == "released"
            assert second.expires_at == clock_us(clock) + 60 * 1_000_000
        finally:
            await pool.handoff.close()


async def test_a_pool_that_cannot_make_a_worker_tries_again_after_1_then_2_s(
    tmp_path: Path, clock: Clock
) -> None:
    """A pool worker that cannot be made (its image is not on the engine) is tried
    again after 1 s, then 2 s, … on the service's clock: never sooner, so a broken
    provider is not asked on every pass."""

    def creates(cut: DockerProxy) -> int:
        return sum("/containers/create" in seen for seen in cut.seen)

    async with on_docker(tmp_path, clock, image="openalice-no-such-image:none") as docker:
        pool = open_pool(docker.service, target=1, max_idle_seconds=60)
        try:
            assert await pool.refill() == {"recycled": 0, "warmed": 0}
            tried = creates(docker.cut)
            assert tried == 1
            for wait in (1, 2):
                clock.move(wait - 0.001)
                assert await pool.refill() == {"recycled": 0, "warmed": 0}
                assert creates(docker.cut) == tried, "asked again before its backoff"
                clock.move(0.001)
                assert await pool.refill() == {"recycled": 0, "warmed": 0}
                assert creates(docker.cut) == tried + 1, "not asked again after its backoff"
                tried += 1
        finally:
            await pool.handoff.close()


async def test_a_pool_pass_takes_nothing_while_an_idle_worker_gives_its_room_to_an_acquire(
    tmp_path: Path, clock: Clock
) -> None:
    """Room for one worker, held by an idle pool worker: a cold acquire of another kind
    has it destroyed and takes its room, and a pass of the pool that sizes (another
    replica's, with nothing in memory of this one's acquire), run the moment the worker
    is gone, makes no worker in that room. It once did, on a busy machine: the room was
    free between the destruction and the acquire's reservation, the pass took it, and
    the acquire was refused: no room left."""
    async with on_docker(tmp_path, clock, local_docker_max_workers=1) as docker:
        service = docker.service
        sizing = open_pool(service, target=1, max_idle_seconds=60)  # the other replica's
        taking = open_pool(service, target=1, max_idle_seconds=60)  # this one's
        destroy, passes = taking.ending.destroy, []

        async def destroy_then_a_pass(record: LeaseRecord) -> str | None:
            problem = await destroy(record)
            if not passes:
                passes.append(await sizing.refill())
            return problem

        try:
            assert await sizing.refill() == {"recycled": 0, "warmed": 1}
            [idle] = await sizing.store.idle()
            taking.ending.destroy = destroy_then_a_pass  # type: ignore[method-assign]
            lease = await service.acquire(LeaseRequest(kind=WorkerKind.anim))
            assert passes == [{"recycled": 0, "warmed": 0}]
            assert (await service.get(idle.lease_id)).state == "released"
            assert (await service.get(lease.lease_id)).state == "active"
            assert await sizing.refill() == {"recycled": 0, "warmed": 0}  # the room is the lease's
            await service.release(lease.lease_id, None)
            assert await sizing.refill() == {"recycled": 0, "warmed": 1}
        finally:
            await sizing.handoff.close()
            await taking.handoff.close()


async def test_an_idle_worker_that_cannot_be_destroyed_keeps_its_room_from_the_acquire(
    tmp_path: Path, clock: Clock
) -> None:
    """The engine cut off while the idle pool worker in the room is being destroyed: its
    worker still runs, so the acquire that took over its room is refused (no second
    worker made beside it), and the destruction is retried until it is confirmed."""
    async with on_docker(tmp_path, clock, local_docker_max_workers=1) as docker:
        service, cut = docker.service, docker.cut
        pool = open_pool(service, target=1, max_idle_seconds=60)
        destroy = pool.ending.destroy

        async def destroy_cut_off(record: LeaseRecord) -> str | None:
            cut.stop()
            try:
                return await destroy(record)
            finally:
                cut.start()

        try:
            assert await pool.refill() == {"recycled": 0, "warmed": 1}
            [idle] = await pool.store.idle()
            pool.ending.destroy = destroy_cut_off  # type: ignore[method-assign]
            with pytest.raises(NoProviderAvailable, match="pool worker in the room was not"):
                await service.acquire(LeaseRequest(kind=WorkerKind.anim))
            pool.ending.destroy = destroy  # type: ignore[method-assign]
            workers = await service.core.by_name["local-docker"].list_workers()
            assert list(workers) == [idle.lease_id]  # its worker alone: none made beside it
            record = await service.get(idle.lease_id)
            assert record.state == LeaseState.releasing
            assert await service.store.live() == [record]  # the acquire's row ended failed
            clock.move(1)
            assert await service.release_due() == 1
            assert (await service.get(idle.lease_id)).state == LeaseState.released
            lease = await service.acquire(LeaseRequest(kind=WorkerKind.anim))
            assert (await service.get(lease.lease_id)).state == LeaseState.active
        finally:
            await pool.handoff.close()


def clock_us(clock: Clock) -> int:
    return to_us(clock.now())


async def _until(read: Callable[[], Awaitable[LeaseRecord]], state: str) -> LeaseRecord:
    for _ in range(600):
        record = await read()
        if record.state == state:
            return record
        await asyncio.sleep(0.05)  # sleep: the other acquire runs on this loop meanwhile
    raise AssertionError(f"never {state}")
