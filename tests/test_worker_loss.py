"""The worker seen after its hand-out (issue 33), on the real Docker engine: a container
that stops (exits, is killed, is OOM-killed by the kernel) ends its lease within
moments, heard from the engine's event stream: `released`, reason `lost`, its cause and
exit code; a renewal answers 409 `worker_lost`; its room is free at once; its remains
are removed. And nothing is ended by mistake: a worker slow to listen, a stream that
breaks and comes back, a restart, two replicas hearing one death, a renewal racing it.

The reconciler is set to an hour in the tests of the stream, so that only the stream can
have noticed; where a listing must find a death (a restart), it runs as it does."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from openalice_scheduler.config import Settings
from openalice_scheduler.providers.base import WorkerEnded
from openalice_scheduler.providers.docker import DockerFleetProvider
from openalice_scheduler.providers.docker import engine as docker_engine
from openalice_scheduler.providers.docker import events as docker_events
from openalice_scheduler.providers.docker.engine import (
    LABEL_INSTANCE,
    LABEL_LEASE,
    DockerEngine,
    exited,
)
from openalice_scheduler.providers.docker.hosts import HostConfig
from tests.dockerproxy import DockerProxy
from tests.harness import (
    SECRET,
    SHARED_ENGINE,
    WORKER_IMAGE,
    Scheduler,
    docker_client,
    fetch_in_network,
    remove_instance,
    wait_for,
)
from tests.loss import end_of, ended, lease_now, lost, renew, renewal_refused_as_lost
from tests.oom import oom_kill_docker_hears
from tests.test_replicas import Replicas, replicas  # noqa: F401 - the fixture
from tests.test_warm_pool import wait_idle

Make = Callable[..., Scheduler]
# Only the event stream may notice, in these tests: no reconcile pass within them.
STREAM_ONLY = {"RECONCILE_INTERVAL_SECONDS": "3600"}


def container_address(lease: dict[str, Any]) -> str:
    """The worker's own address (the host reaches a container on its network)."""
    container = docker_client().containers.get(lease["provider_token"])
    networks = container.attrs["NetworkSettings"]["Networks"]
    address = next(iter(networks.values()))["IPAddress"]
    return f"http://{address}:8080"


def settings_of_a_new_instance() -> tuple[str, Settings]:
    """A SCHEDULER_INSTANCE of its own, and settings for the scheduler's view of the shared
    engine for it (in this process: the tests hand it events or containers of their own)."""
    instance = f"t-{uuid.uuid4().hex[:10]}"
    settings = Settings(  # type: ignore[call-arg]
        internal_secret=SECRET,
        scheduler_instance=instance,
        docker_network="bridge",
        local_gpu_devices="",
    )
    return instance, settings


def engine_of_a_new_instance() -> tuple[str, DockerEngine]:
    instance, settings = settings_of_a_new_instance()
    return instance, DockerEngine(settings, SHARED_ENGINE)


def test_a_killed_container_ends_its_lease_and_frees_its_room(make_scheduler: Make) -> None:
    s = make_scheduler(LOCAL_DOCKER_MAX_WORKERS="1", **STREAM_ONLY)
    lease = s.lease(owner_id="me", ttl_seconds=600)
    assert s.acquire().status_code == 503  # at capacity, as the issue found it

    docker_client().containers.get(lease["provider_token"]).kill()
    lost(s, lease, "exited", 137)
    # The caller hears it: its renewal is refused, naming the cause.
    renewal_refused_as_lost(s, lease, "exited", 137)
    # Its room is free: the next caller is served; its remains are removed.
    assert s.acquire().status_code == 200
    wait_for(
        lambda: lease["provider_token"] not in [c.id for c in s.containers()],
        30,
        what="the dead container removed",
    )
    assert s.metric("scheduler_workers_lost_total", provider="local-docker", cause="exited") == 1
    assert s.metric("scheduler_leases_released_total", provider="local-docker", reason="lost") == 1


def test_a_worker_that_exits_has_its_exit_code_on_its_lease(make_scheduler: Make) -> None:
    s = make_scheduler(**STREAM_ONLY)
    lease = s.lease(ttl_seconds=600)
    httpx.get(container_address(lease) + "/cgi-bin/exit?3", timeout=10)
    lost(s, lease, "exited", 3)


def test_an_oom_killed_worker_is_lost_as_oom_killed(make_scheduler: Make) -> None:
    s = make_scheduler(**STREAM_ONLY)

    def make() -> tuple[str, dict[str, Any]]:
        lease = s.lease(ttl_seconds=600)
        container = docker_client().containers.get(lease["provider_token"])
        # A memory limit the worker then outgrows: the kernel's OOM killer ends it.
        container.update(mem_limit="32m", memswap_limit="32m")
        httpx.get(container_address(lease) + "/cgi-bin/hog", timeout=10)
        return container.id, ended(s, lease)

    def lost_by_docker(lease: dict[str, Any]) -> None:
        # Docker did not say OOMKilled (tests/oom.py): its worker exited with 137, for all
        # the scheduler can know.
        assert end_of(lease) == ("released", "lost", "exited", 137), lease

    lease = oom_kill_docker_hears(make, lost_by_docker)
    assert end_of(lease) == ("released", "lost", "oom_killed", 137), lease
    assert (
        s.metric("scheduler_workers_lost_total", provider="local-docker", cause="oom_killed") == 1
    )


async def test_an_oom_kill_whose_die_comes_before_its_oom_is_told_as_an_oom_kill(
    monkeypatch: Any,
) -> None:
    """Docker may send an OOM kill's `die` before its `oom` (two goroutines of containerd's
    shim; the emulators' test of a real OOM kill saw it once under load), which cannot be
    made on purpose: the events are handed to the stream's reader in that order, for real
    SIGKILLed containers. One with a memory limit, as the OOM-killed worker above: its
    `die` waits for the `oom`, and is told as an OOM kill. One without (nothing the OOM
    killer's word could speak of): told at once, as killed. One with a limit and no `oom`:
    told as killed once the grace is over."""
    instance, engine = engine_of_a_new_instance()
    made = {}
    reader: asyncio.Task[None] | None = None
    try:
        for name, limit in (("late", "32m"), ("unlimited", None), ("silent", "32m")):
            container = docker_client().containers.run(
                WORKER_IMAGE,
                detach=True,
                mem_limit=limit,
                labels={LABEL_INSTANCE: instance, LABEL_LEASE: name},
            )
            made[name] = container
            container.kill()
            assert container.wait(timeout=60)["StatusCode"] == 137
        monkeypatch.setattr(docker_events, "OOM_GRACE_S", 30.0)
        events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        told: asyncio.Queue[WorkerEnded] = asyncio.Queue()

        def event(action: str, name: str) -> dict[str, Any]:
            attributes = {"exitCode": "137", LABEL_LEASE: name} if action == "die" else {}
            return {"Action": action, "Actor": {"ID": made[name].id, "Attributes": attributes}}

        async def read() -> None:
            async for death in docker_events.deaths_in(engine, events):
                await told.put(death)

        async def next_death() -> tuple[str | None, str, int | None, str]:
            ended = await asyncio.wait_for(told.get(), 30)
            return ended.lease_id, ended.death.cause, ended.death.exit_code, ended.death.detail

        reader = asyncio.create_task(read())
        events.put_nowait(event("die", "late"))
        events.put_nowait(event("die", "unlimited"))
        killed = "its container exited with code 137"
        assert await next_death() == ("unlimited", "exited", 137, killed)
        assert told.empty()  # the limited one waits for its `oom`
        events.put_nowait(event("oom", "late"))
        oom = "the kernel's OOM killer ended it"
        assert await next_death() == ("late", "oom_killed", 137, oom)

        monkeypatch.setattr(docker_events, "OOM_GRACE_S", 0.2)
        events.put_nowait(event("die", "silent"))
        assert await next_death() == ("silent", "exited", 137, killed)
        events.put_nowait(None)
        await asyncio.wait_for(reader, 30)
    finally:
        if reader is not None:
            reader.cancel()
        await engine.close()
        remove_instance(instance)


async def test_a_listing_leaves_a_fresh_kill_that_may_be_an_oom_kill_to_the_next_pass(
    monkeypatch: Any,
) -> None:
    """A reconcile pass lists stopped workers with their deaths, as their state says. A
    SIGKILLed container with a memory limit of its own, not (yet) said OOM-killed, may be
    an OOM kill whose `die` came before its `oom` (above; Docker 20.10 then never says
    OOMKilled): within OOM_GRACE_S of its end the listing tells no death yet, so that a
    pass falling between the two does not record an OOM-killed worker as killed. Once the
    grace is over it is told as it stands. Any other end is told at once."""
    instance, engine = engine_of_a_new_instance()
    client = docker_client()
    try:
        for name, limit, command in (
            ("limited", "32m", None),
            ("unlimited", None, None),
            ("exits", "32m", ["-c", "exit 3"]),
        ):
            container = client.containers.run(
                WORKER_IMAGE,
                detach=True,
                mem_limit=limit,
                labels={LABEL_INSTANCE: instance, LABEL_LEASE: name},
                **({"entrypoint": "sh", "command": command} if command else {}),
            )
            if command is None:
                container.kill()
            container.wait(timeout=60)
        # A grace longer than this test can take: what is listed now is within it.
        monkeypatch.setattr(docker_engine, "OOM_GRACE_S", 600.0)
        listed = await engine.list_workers()
        deaths = {name: [i.death for i in infos] for name, infos in listed.items()}
        assert deaths == {"limited": [None], "unlimited": [exited(137)], "exits": [exited(3)]}
        monkeypatch.setattr(docker_engine, "OOM_GRACE_S", 0.0)
        [late] = (await engine.list_workers())["limited"]
        assert late.death == exited(137)
    finally:
        await engine.close()
        remove_instance(instance)


@pytest.mark.parametrize("through", ["one engine", "a fleet"])
async def test_a_worker_being_removed_is_listed_as_ending_not_as_an_orphan_to_end_again(
    through: str,
) -> None:
    """A container Docker is removing (`docker rm -f` by hand, or a release) is listed
    `removing` while that lasts, long enough on a busy engine for a reconcile pass to
    find it after its lease ended (its `die` heard meanwhile): listed as a worker whose
    end is under way, it is not destroyed again and counted an orphan (seen in a loaded
    run of test_lifecycle.py's reconcile test: two orphans counted for its one). So is a
    fleet's (DOCKER_HOSTS), which lists each host's engine. A removal's moment is
    Docker's: each of up to 20 containers is listed while it lasts."""
    instance, settings = settings_of_a_new_instance()
    workers = (
        DockerEngine(settings, SHARED_ENGINE)
        if through == "one engine"
        else DockerFleetProvider(settings, [HostConfig("here", SHARED_ENGINE)])
    )
    client = docker_client()
    listed: list[bool] = []  # `ending`, as each listing during a removal said
    try:
        for _ in range(20):
            lease_id = str(uuid.uuid4())
            container = client.containers.run(
                WORKER_IMAGE,
                detach=True,
                network_mode="none",
                labels={LABEL_INSTANCE: instance, LABEL_LEASE: lease_id},
            )
            [running] = (await workers.list_workers())[lease_id]
            assert (running.ending, running.death) == (False, None)  # alive: no end under way
            removal = threading.Thread(
                target=client.api.remove_container, args=(container.id,), kwargs={"force": True}
            )
            removal.start()
            while removal.is_alive():
                listed += [i.ending for i in (await workers.list_workers()).get(lease_id, [])]
            removal.join()
            assert lease_id not in await workers.list_workers()
            if any(listed):
                break
        assert any(listed), listed
    finally:
        await workers.close()
        remove_instance(instance)  # what a failed assertion above left


def test_a_worker_slow_to_listen_is_handed_out_ready_and_kept(make_scheduler: Make) -> None:
    s = make_scheduler(**STREAM_ONLY)
    # Its container runs at once; its port answers 3 s later. Probed by a TCP connect.
    started = time.monotonic()
    lease = s.lease(ttl_seconds=600, env={"LISTEN_DELAY_SECONDS": "3"})
    assert time.monotonic() - started >= 3
    # The caller's first request succeeds, from inside the network as a caller's would.
    page = fetch_in_network(s.env["DOCKER_NETWORK"], lease["endpoint"] + "/")
    assert lease["lease_id"] in page
    assert lease_now(s, lease)["state"] == "active"


def test_a_stream_cut_off_misses_no_death_and_ends_no_healthy_lease(make_scheduler: Make) -> None:
    where = Path(tempfile.mkdtemp(prefix="oa-cut-", dir="/tmp"))
    with DockerProxy(where / "docker.sock").start() as cut:
        s = make_scheduler(DOCKER_HOST=cut.url, **STREAM_ONLY)
        healthy, doomed = s.lease(ttl_seconds=600), s.lease(ttl_seconds=600)
        cut.stop()  # the event stream breaks; the engine runs on
        docker_client().containers.get(doomed["provider_token"]).kill()
        wait_for(
            lambda: docker_client().containers.get(doomed["provider_token"]).status == "exited",
            30,
            what="the worker dead, unheard",
        )
        assert lease_now(s, doomed)["state"] == "active"  # nobody could know
        cut.start()
        # The stream again, and a listing for what it missed (the reconciler woken).
        lost(s, doomed, "exited", 137)
        assert lease_now(s, healthy)["state"] == "active"
        # And the new stream hears the next death as the first one did.
        docker_client().containers.get(healthy["provider_token"]).kill()
        lost(s, healthy, "exited", 137)


def test_a_death_while_the_scheduler_is_down_is_found_at_its_restart(
    make_scheduler: Make,
) -> None:
    s = make_scheduler(**STREAM_ONLY)
    doomed, healthy = s.lease(ttl_seconds=600), s.lease(ttl_seconds=600)
    s.kill()
    httpx.get(container_address(doomed) + "/cgi-bin/exit?7", timeout=10)
    wait_for(
        lambda: docker_client().containers.get(doomed["provider_token"]).status == "exited",
        30,
        what="the worker exited",
    )
    s.start()  # start-up reconciliation lists the workers
    assert end_of(lease_now(s, doomed)) == ("released", "lost", "exited", 7)
    assert lease_now(s, healthy)["state"] == "active"


def test_two_replicas_hear_one_death_and_end_its_lease_once(replicas: Replicas) -> None:  # noqa: F811
    a, b = replicas(**STREAM_ONLY)
    lease = a.lease(ttl_seconds=600)
    docker_client().containers.get(lease["provider_token"]).kill()
    lost(b, lease, "exited", 137)
    # Both heard it; one ended it, once.
    # sleep: nothing tells when the other replica has heard it too and found the lease
    # ended (it says nothing then, and counts nothing): give it a moment.
    time.sleep(2)
    counted = [
        r.metric("scheduler_workers_lost_total", provider="local-docker", cause="exited")
        for r in (a, b)
    ]
    assert sorted(counted) == [0, 1]
    assert sum(r.log().count(f"lease {lease['lease_id']}: its worker") for r in (a, b)) == 1


def test_a_renewal_racing_the_death_is_answered_200_or_409_never_more(
    make_scheduler: Make,
) -> None:
    s = make_scheduler(**STREAM_ONLY)
    lease = s.lease(owner_id="me", ttl_seconds=600)
    answers: list[int] = []
    stop = threading.Event()

    def renewing() -> None:
        while not stop.is_set():
            answers.append(renew(s, lease).status_code)

    racer = threading.Thread(target=renewing)
    racer.start()
    try:
        wait_for(lambda: len(answers) >= 3, 30, what="renewals under way")
        docker_client().containers.get(lease["provider_token"]).kill()
        ended(s, lease)
        wait_for(lambda: answers[-1] == 409, 30, what="a renewal refused")
    finally:
        stop.set()
        racer.join(30)
    # Each renewal was served until the death, refused after: never resurrected.
    assert set(answers) <= {200, 409}, answers
    first_refused = answers.index(409)
    assert all(code == 409 for code in answers[first_refused:]), answers
    assert lease_now(s, lease)["state"] == "released"


def test_an_idle_pool_worker_that_dies_is_recycled_and_replaced(make_scheduler: Make) -> None:
    s = make_scheduler(WARM_POOL="renderer/none=1", **STREAM_ONLY)
    wait_idle(s, 1)
    [row] = s.http.get("/v1/leases", params={"state": "idle"}).json()
    idle = docker_client().containers.get(row["provider_token"])
    pool_lease = {"lease_id": row["lease_id"]}
    idle.kill()
    lost(s, pool_lease, "exited", 137, reason="recycled")
    # A new one takes its place, and serves the next caller warm.
    wait_for(
        lambda: [c for c in s.containers() if c.status == "running" and c.id != idle.id],
        60,
        what="a new idle worker",
    )
    wait_idle(s, 1)
    lease = s.lease(ttl_seconds=600)
    assert lease["provider_token"] != idle.id
