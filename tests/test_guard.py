"""The guard (README, The guard): with every scheduler dead it destroys the workers whose
lease has ended, within silence + grace + one poll, and nothing else; the scheduler
coming back finds a coherent state. Real processes throughout: the scheduler and the
guard (`openalice-scheduler guard`) as processes, `kill -9`, Docker and the RunPod
emulator on both transports."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import pytest

from tests.guardproc import FAST, CutProxy, GuardProcess
from tests.harness import SECRET, Scheduler, wait_for
from tests.runpod_emulator import RunPodEmulator

KEY = "rpk-guard-" + uuid.uuid4().hex
LEASE_LABEL = "openalice.scheduler.lease_id"
POLL, SILENCE, GRACE = (float(FAST[k]) for k in
                        ("GUARD_POLL_SECONDS", "GUARD_SILENCE_SECONDS", "GUARD_GRACE_SECONDS"))
# On top of the bound (silence + grace + one poll): the provider's own time to destroy,
# and a loaded test machine.
SLACK_S = 30


def at(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def contact(sched: Scheduler, guard: GuardProcess, provider: str) -> float | None:
    """The guard's last contact as `GET /v1/providers` shows it (None: never)."""
    for view in sched.http.get("/v1/providers").json():
        if view["name"] == provider:
            for seen in view["guards"]:
                if seen["guard_id"] == guard.guard_id:
                    return at(seen["last_contact"])
    return None


def polled_since(sched: Scheduler, guard: GuardProcess, provider: str, since: float) -> bool:
    seen = contact(sched, guard, provider)
    return seen is not None and seen >= since


class Workers:
    """The workers of one scheduler on one provider, by lease id, as the provider says."""

    def __init__(self, alive: Callable[[str], bool]) -> None:
        self.alive = alive


def docker_workers(sched: Scheduler) -> Workers:
    def alive(lease_id: str) -> bool:
        return any(c.labels.get(LEASE_LABEL) == lease_id and c.status == "running"
                   for c in sched.containers())
    return Workers(alive)


def runpod_workers(runpod: RunPodEmulator, sched: Scheduler) -> Workers:
    def alive(lease_id: str) -> bool:
        return any(p.name.startswith(f"oa-{sched.instance}-") and lease_id in p.name
                   and p.status != "TERMINATED" for p in runpod.list_pods())
    return Workers(alive)


def never_early(workers: Workers, lease: dict[str, Any]) -> None:
    """The worker still runs until its lease's end + grace (checked only while this test
    is itself on time: a late look proves nothing either way)."""
    until = at(lease["expires_at"]) + GRACE - 0.5
    while time.time() < until:
        alive = workers.alive(lease["lease_id"])
        if time.time() < until:
            assert alive, "the guard destroyed a worker before its lease's end + grace"
        time.sleep(0.25)


def gone_within_bound(workers: Workers, lease: dict[str, Any], last_contact: float) -> None:
    """Destroyed by max(last contact + silence, end + grace) + one poll (README)."""
    bound = max(last_contact + SILENCE, at(lease["expires_at"]) + GRACE) + POLL
    wait_for(lambda: not workers.alive(lease["lease_id"]), timeout=bound - time.time() + SLACK_S,
             interval=0.25, what="the guard to destroy the expired lease's worker")


def back_and_coherent(sched: Scheduler, guard: GuardProcess, short: dict[str, Any],
                      long: dict[str, Any], workers: Workers, provider: str) -> None:
    """The scheduler started again: the short lease released as expired ("already gone"
    confirms it), the long one active with its worker, no release retried or failed."""
    sched.start()

    def state(lease: dict[str, Any]) -> dict[str, Any]:
        return sched.http.get(f"/v1/lease/{lease['lease_id']}").json()

    wait_for(lambda: state(short)["state"] == "released", timeout=60,
             what="the expired lease released once the scheduler is back")
    assert state(short)["release_reason"] == "expired"
    assert state(long)["state"] == "active" and workers.alive(long["lease_id"])
    assert sched.metric("scheduler_release_failures_total", provider=provider) == 0
    assert sched.metric("scheduler_leases_released_total", provider=provider,
                        reason="expired") == 1
    wait_for(lambda: "a scheduler answers again; standing down" in guard.log(), timeout=30,
             what="the guard standing down")
    # Destroyed once, by the guard; the scheduler only confirmed it gone.
    assert guard.log().count(f"destroyed the worker of lease {short['lease_id']}") == 1
    assert long["lease_id"] not in guard.log()
    assert SECRET not in guard.log()


def leases_learned(sched: Scheduler, guard: GuardProcess, provider: str,
                   **body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A 5 s and a 600 s lease, once the guard has polled since both exist."""
    wait_for(lambda: contact(sched, guard, provider) is not None, timeout=60,
             what="the guard's first poll")
    short = sched.lease(ttl_seconds=5, **body)
    long = sched.lease(ttl_seconds=600, **body)
    made = time.time()
    wait_for(lambda: polled_since(sched, guard, provider, made), timeout=30,
             what="a poll of the guard after both leases")
    return short, long


# --- Docker ------------------------------------------------------------------------------


def test_docker_worker_destroyed_within_the_bound_when_the_scheduler_is_dead(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler()
    guard = GuardProcess(sched).start()
    try:
        workers = docker_workers(sched)
        short, long = leases_learned(sched, guard, "local-docker")
        last = contact(sched, guard, "local-docker")
        assert last is not None
        sched.kill()
        never_early(workers, short)
        gone_within_bound(workers, short, last)
        time.sleep(POLL * 4)  # a few more passes of the guard: the long lease is untouched
        assert workers.alive(long["lease_id"])
        back_and_coherent(sched, guard, short, long, workers, "local-docker")
    finally:
        guard.kill()


def test_a_guard_killed_mid_silence_resumes_from_its_disk(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """Killed after the silence began and started again: it still knows the short lease's
    end (without its file it would wait the longest TTL, 8 h, for a worker it has never
    seen in a lease), so the worker goes within the bound; the long lease's stays."""
    sched = make_scheduler()
    guard = GuardProcess(sched).start()
    try:
        workers = docker_workers(sched)
        short, long = leases_learned(sched, guard, "local-docker")
        last = contact(sched, guard, "local-docker")
        assert last is not None
        sched.kill()
        time.sleep(SILENCE / 2)
        guard.kill()
        assert guard.state_file.exists()
        time.sleep(1)
        guard.start()
        never_early(workers, short)
        gone_within_bound(workers, short, last)
        time.sleep(POLL * 4)
        assert workers.alive(long["lease_id"])
    finally:
        guard.kill()


def test_a_guard_alone_cut_off_acts_on_what_it_last_learned(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """The documented behaviour when only the guard is cut off (README, The guard): the
    scheduler lives and the caller renews, but the guard cannot learn of it. It destroys
    the worker once the end it last learned + GUARD_GRACE_SECONDS has passed (never
    before); the scheduler then finds the worker gone and ends the lease `lost`. The
    long lease is untouched, and the guard's silence shows in GET /v1/providers."""
    sched = make_scheduler(RECONCILE_INTERVAL_SECONDS="1")
    with CutProxy(sched.port) as proxy:
        guard = GuardProcess(sched, url=proxy.url).start()
        try:
            workers = docker_workers(sched)
            short, long = leases_learned(sched, guard, "local-docker")
            proxy.cut()
            learned = short  # what the guard knows: the 5 s lease's first end
            # The caller renews through the scheduler, which the guard cannot see.
            renewed = sched.http.post(f"/v1/lease/{short['lease_id']}/renew",
                                      json={"ttl_seconds": 600})
            assert renewed.status_code == 200, renewed.text
            never_early(workers, learned)
            gone_within_bound(workers, learned, time.time())

            def state() -> dict[str, Any]:
                return sched.http.get(f"/v1/lease/{short['lease_id']}").json()

            wait_for(lambda: state()["state"] == "released", timeout=60,
                     what="the scheduler finding the renewed lease's worker gone")
            assert state()["release_reason"] == "lost"
            assert workers.alive(long["lease_id"])
            silent = [g for v in sched.http.get("/v1/providers").json()
                      for g in v["guards"] if g["guard_id"] == guard.guard_id]
            assert silent and silent[0]["silent_seconds"] >= SILENCE
        finally:
            guard.kill()


# --- RunPod (the emulator, both transports) ----------------------------------------------


@pytest.fixture
def runpod(runpod_server: RunPodEmulator) -> Iterator[RunPodEmulator]:
    runpod_server.reset()
    runpod_server.provision_delay = 0.3
    yield runpod_server


def test_runpod_pod_terminated_within_the_bound_when_the_scheduler_is_dead(
    make_scheduler: Callable[..., Scheduler], runpod: RunPodEmulator, api: str,
) -> None:
    sched = make_scheduler(
        PROVIDERS="runpod", RUNPOD_API=api, RUNPOD_API_KEY=KEY,
        RUNPOD_API_BASE_URL=runpod.base_url, RUNPOD_POLL_INTERVAL_SECONDS="0.1",
        RUNPOD_CATALOG_TTL_SECONDS="0", RUNPOD_REQUEST_TIMEOUT_SECONDS="10")
    guard = GuardProcess(sched).start()
    try:
        workers = runpod_workers(runpod, sched)
        short, long = leases_learned(sched, guard, "runpod", gpu="mid")
        assert workers.alive(short["lease_id"]) and workers.alive(long["lease_id"])
        last = contact(sched, guard, "runpod")
        assert last is not None
        sched.kill()
        never_early(workers, short)
        gone_within_bound(workers, short, last)
        time.sleep(POLL * 4)
        assert workers.alive(long["lease_id"])
        back_and_coherent(sched, guard, short, long, workers, "runpod")
        assert KEY not in guard.log()
    finally:
        guard.kill()


# --- start-up ----------------------------------------------------------------------------


def test_a_guard_that_cannot_start_says_why_in_one_line(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """Without GUARD_SCHEDULER_URL, or with a state file it cannot read (starting afresh
    would forget every deadline it kept), the guard exits 2 with one line naming it."""
    sched = make_scheduler(start=False)
    unset = GuardProcess(sched)
    del unset.env["GUARD_SCHEDULER_URL"]
    broken = GuardProcess(sched, name="broken")
    broken.state_file.write_text("{not json")
    for guard, named in ((unset, "GUARD_SCHEDULER_URL"), (broken, "GUARD_STATE_FILE")):
        guard.start()
        assert guard.proc is not None
        assert guard.proc.wait(60) == 2, guard.log()
        lines = [line for line in guard.log().splitlines() if line.strip()]
        assert len(lines) == 1 and named in lines[0], guard.log()
        assert SECRET not in guard.log()
