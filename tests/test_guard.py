"""The guard (docs/concepts/guard.md#the-guard): with every scheduler dead it destroys the workers
whose lease has ended, within silence + grace + one poll, and nothing else; the scheduler coming
back finds a coherent state. Real processes throughout: the scheduler and the guard
(`openalice-scheduler guard`) as processes, `kill -9`, Docker and the RunPod emulator on both
transports."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx

from tests.guardproc import FAST, CutProxy, GuardProcess
from tests.harness import HTTP, SECRET, Scheduler, wait_for
from tests.runpod_emulator import RunPodEmulator
from tests.runpod_setup import pods_of
from tests.test_lifecycle import container_stops

KEY = "rpk-guard-" + uuid.uuid4().hex
LEASE_LABEL = "openalice.scheduler.lease_id"
POLL, SILENCE, GRACE = (
    float(FAST[k]) for k in ("GUARD_POLL_SECONDS", "GUARD_SILENCE_SECONDS", "GUARD_GRACE_SECONDS")
)
# On top of the bound (silence + grace + one poll): the provider's own time to destroy,
# and a loaded test machine.
SLACK_S = 30


def at(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def guard_view(sched: Scheduler, guard: GuardProcess, provider: str) -> dict[str, Any] | None:
    """The guard as `GET /v1/providers` shows it under `provider` (None: never polled)."""
    for view in sched.http.get("/v1/providers").json():
        if view["name"] == provider:
            for seen in view["guards"]:
                if seen["guard_id"] == guard.guard_id:
                    return dict(seen)
    return None


def contact(sched: Scheduler, guard: GuardProcess, provider: str) -> float | None:
    """The guard's last contact (None: never)."""
    seen = guard_view(sched, guard, provider)
    return None if seen is None else at(seen["last_contact"])


def lease_state(sched: Scheduler, lease: dict[str, Any]) -> dict[str, Any]:
    return dict(sched.http.get(f"/v1/lease/{lease['lease_id']}").json())


# Whether the worker of a lease id runs, as its provider says.
Alive = Callable[[str], bool]
# When a lease's worker was first stopped, or its provider first asked to stop it (unix
# time, by the provider's own record); None: never.
Stopped = Callable[[dict[str, Any]], float | None]


def docker_workers(sched: Scheduler) -> Alive:
    def alive(lease_id: str) -> bool:
        return any(
            c.labels.get(LEASE_LABEL) == lease_id and c.status == "running"
            for c in sched.containers()
        )

    return alive


def runpod_workers(runpod: RunPodEmulator, sched: Scheduler) -> Alive:
    def alive(lease_id: str) -> bool:
        return any(lease_id in p.name and p.status != "TERMINATED" for p in pods_of(runpod, sched))

    return alive


def docker_stops(stops: dict[str, float]) -> Stopped:
    """From the engine's events (`container_stops`): its containers' first kill, die, stop
    or destroy."""
    return lambda lease: stops.get(lease["lease_id"])


def runpod_stops(runpod: RunPodEmulator) -> Stopped:
    """From the emulator's record of calls: the first terminate of the lease's pod."""

    def stopped(lease: dict[str, Any]) -> float | None:
        asked = [c.at for c in runpod.calls("terminate") if c.pod_id == lease["provider_token"]]
        return min(asked, default=None)

    return stopped


def never_early(stopped: Stopped, lease: dict[str, Any]) -> None:
    """The worker ran until its lease's end + grace: by the provider's own record, it was
    stopped, or its provider asked to, no earlier (1 ms for the clocks' rounding)."""
    when = wait_for(lambda: stopped(lease), 30, what="the provider's record of the worker's stop")
    due = at(lease["expires_at"]) + GRACE
    assert when >= due - 0.001, (
        f"the guard destroyed a worker {due - when:.3f} s before its lease's end + grace"
    )


def guard_passes(guard: GuardProcess, n: int) -> None:
    """Wait for `n` more passes of the guard: each ends by writing its state file anew (a
    new file renamed over the old, memory.py), so the last n - 1 run wholly from now on."""

    def written() -> tuple[int, int] | None:
        try:
            stat = guard.state_file.stat()
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns

    last = written()
    for i in range(n):
        last = wait_for(
            lambda last=last: (now := written()) != last and now,
            30,
            what=f"pass {i + 1} of {n} of the guard (its state file written)",
        )


def gone_within_bound(alive: Alive, lease: dict[str, Any], last_contact: float) -> None:
    """Destroyed by max(last contact + silence, end + grace) + one poll
    (docs/concepts/guard.md#the-guarantee)."""
    bound = max(last_contact + SILENCE, at(lease["expires_at"]) + GRACE) + POLL
    wait_for(
        lambda: not alive(lease["lease_id"]),
        timeout=bound - time.time() + SLACK_S,
        interval=0.25,
        what="the guard to destroy the expired lease's worker",
    )


def only_the_expired_goes(
    alive: Alive,
    stopped: Stopped,
    guard: GuardProcess,
    short: dict[str, Any],
    long: dict[str, Any],
    last_contact: float,
) -> None:
    """The short lease's worker is gone within the bound, having run until its end +
    grace; four more passes of the guard later, the long lease's worker still runs, and
    nothing ever asked its provider to stop it."""
    gone_within_bound(alive, short, last_contact)
    never_early(stopped, short)
    guard_passes(guard, 4)
    assert alive(long["lease_id"])
    assert stopped(long) is None


def back_and_coherent(
    sched: Scheduler,
    guard: GuardProcess,
    short: dict[str, Any],
    long: dict[str, Any],
    alive: Alive,
    provider: str,
) -> None:
    """The scheduler started again: the short lease released as expired ("already gone"
    confirms it), the long one active with its worker, no release retried or failed."""
    sched.start()
    wait_for(
        lambda: lease_state(sched, short)["state"] == "released",
        timeout=60,
        what="the expired lease released once the scheduler is back",
    )
    assert lease_state(sched, short)["release_reason"] == "expired"
    assert lease_state(sched, long)["state"] == "active" and alive(long["lease_id"])
    assert sched.metric("scheduler_release_failures_total", provider=provider) == 0
    assert sched.metric("scheduler_leases_released_total", provider=provider, reason="expired") == 1
    wait_for(
        lambda: "a scheduler answers again; standing down" in guard.log(),
        timeout=30,
        what="the guard standing down",
    )
    # Destroyed once, by the guard; the scheduler only confirmed it gone.
    assert guard.log().count(f"destroyed the worker of lease {short['lease_id']}") == 1
    assert long["lease_id"] not in guard.log()
    assert SECRET not in guard.log()


def guard_knows(guard: GuardProcess, *leases: dict[str, Any]) -> float | None:
    """The guard's own last contact once its memory (the state file it writes after each
    pass) holds every one of `leases` until its current end, else None. The guard's own
    word, not the scheduler's: the scheduler records a poll it answered, but on a loaded
    machine the guard may have given up on that answer (its poll timeout is the poll
    interval, 0.5 s here) and learned nothing."""
    try:
        memory = json.loads(guard.state_file.read_text())
    except FileNotFoundError:  # written whole and renamed over: never half a file
        return None
    for lease in leases:
        until = memory["until"].get(lease["lease_id"])
        if until is None or abs(until - at(lease["expires_at"])) > 1:
            return None
    return float(memory["last_contact"])


def leases_learned(
    sched: Scheduler, guard: GuardProcess, provider: str, short_ttl: int = 5, **body: Any
) -> tuple[dict[str, Any], dict[str, Any], float]:
    """A `short_ttl` (5 s) and a 600 s lease, once the guard has learned both (and the
    short one's end as it now is); and the guard's last contact then.
    The short one has at least half its TTL left then: the caller's next step (killing
    the scheduler, say) must come before its end, or the scheduler, still alive, ends it
    itself (a loaded machine once took a cold start and a poll past it). So it is made
    last, and renewed, and learned again, for as long as it has less."""
    wait_for(
        lambda: contact(sched, guard, provider) is not None,
        timeout=60,
        what="the guard's first poll",
    )
    long = sched.lease(ttl_seconds=600, **body)
    short = sched.lease(ttl_seconds=short_ttl, **body)
    while True:
        last = wait_for(
            lambda short=short: guard_knows(guard, short, long),
            timeout=30,
            what="the guard learning of both leases (its state file)",
        )
        if at(short["expires_at"]) - time.time() >= short_ttl / 2:
            return short, long, last
        renewed = sched.http.post(
            f"/v1/lease/{short['lease_id']}/renew", json={"ttl_seconds": short_ttl}
        )
        if renewed.status_code == 404:
            # It ended before the guard learned of it (a machine so loaded that a poll
            # took its whole TTL): another short lease, learned again.
            short = sched.lease(ttl_seconds=short_ttl, **body)
            continue
        assert renewed.status_code == 200, renewed.text
        short = renewed.json()


@dataclass
class Guarded:
    """Two leases a guard has learned of (`leases_learned`): `short` ends in seconds,
    `long` in 600 s, and `last_contact` is the guard's poll since both exist; their
    scheduler, the guard, and their provider, which `alive` and `stopped` ask."""

    short: dict[str, Any]
    long: dict[str, Any]
    last_contact: float
    sched: Scheduler
    guard: GuardProcess
    provider: str
    alive: Alive
    stopped: Stopped

    def only_the_expired_goes(self) -> None:
        only_the_expired_goes(
            self.alive, self.stopped, self.guard, self.short, self.long, self.last_contact
        )

    def back_and_coherent(self) -> None:
        back_and_coherent(self.sched, self.guard, self.short, self.long, self.alive, self.provider)


@contextmanager
def guarded_leases(
    sched: Scheduler, provider: str, alive: Alive, stopped: Stopped, **body: Any
) -> Iterator[Guarded]:
    """`sched` under a guard (killed at the end) that has learned of two of its leases on
    `provider` (`body`: what else the leases ask for)."""
    guard = GuardProcess(sched).start()
    try:
        short, long, last = leases_learned(sched, guard, provider, **body)
        yield Guarded(short, long, last, sched, guard, provider, alive, stopped)
    finally:
        guard.kill()


# --- Docker ------------------------------------------------------------------------------


@contextmanager
def guarded_on_docker(make_scheduler: Callable[..., Scheduler]) -> Iterator[Guarded]:
    """A scheduler on Docker and its guarded leases (`guarded_leases`), the containers'
    stops recorded by the engine while the block runs."""
    sched = make_scheduler()
    alive = docker_workers(sched)
    with (
        container_stops(sched.instance) as stops,
        guarded_leases(sched, "local-docker", alive, docker_stops(stops)) as guarded,
    ):
        yield guarded


def test_docker_worker_destroyed_within_the_bound_when_the_scheduler_is_dead(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    with guarded_on_docker(make_scheduler) as guarded:
        guarded.sched.kill()
        guarded.only_the_expired_goes()
        guarded.back_and_coherent()


def test_a_guard_killed_mid_silence_resumes_from_its_disk(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """Killed after the silence began and started again: it still knows the short lease's
    end (without its file it would wait the longest TTL, 8 h, for a worker it has never
    seen in a lease), so the worker goes within the bound; the long lease's stays."""
    with guarded_on_docker(make_scheduler) as guarded:
        guarded.sched.kill()
        # The silence has begun: a pass begun after the kill found no scheduler. The
        # short lease's end + grace is seconds away yet.
        guard_passes(guarded.guard, 2)
        guarded.guard.kill()
        assert guarded.guard.state_file.exists()
        guarded.guard.start()
        guarded.only_the_expired_goes()


def test_a_guard_alone_cut_off_acts_on_what_it_last_learned(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """The documented behaviour when only the guard is cut off (docs/concepts/guard.md#the-guard):
    the scheduler lives and the caller renews, but the guard cannot learn of it. It destroys the
    worker once the end it last learned + GUARD_GRACE_SECONDS has passed (never before); the
    scheduler then finds the worker gone and ends the lease `lost`. The long lease is untouched, and
    the guard's silence shows in GET /v1/providers."""
    sched = make_scheduler(RECONCILE_INTERVAL_SECONDS="1")
    with CutProxy(sched.port) as proxy:
        guard = GuardProcess(sched, url=proxy.url).start()
        try:
            alive = docker_workers(sched)
            with container_stops(sched.instance) as stops:
                # 12 s: time to make the long lease, see the guard poll, cut it off and
                # renew through the scheduler before the short one ends, on a loaded machine.
                short, long, _ = leases_learned(sched, guard, "local-docker", short_ttl=12)
                proxy.cut()
                cut_at = time.time()  # the guard's last contact was before
                learned = short  # what the guard knows: the short lease's first end
                # The caller renews through the scheduler, which the guard cannot see.
                renewed = sched.http.post(
                    f"/v1/lease/{short['lease_id']}/renew", json={"ttl_seconds": 600}
                )
                assert renewed.status_code == 200, renewed.text
                gone_within_bound(alive, learned, cut_at)
                never_early(docker_stops(stops), learned)
            wait_for(
                lambda: lease_state(sched, short)["state"] == "released",
                timeout=60,
                what="the scheduler finding the renewed lease's worker gone",
            )
            assert lease_state(sched, short)["release_reason"] == "lost"
            assert alive(long["lease_id"])
            silent = guard_view(sched, guard, "local-docker")
            assert silent is not None and silent["silent_seconds"] >= SILENCE
        finally:
            guard.kill()


# --- RunPod (the emulator, both transports) ----------------------------------------------


def test_runpod_pod_terminated_within_the_bound_when_the_scheduler_is_dead(
    on_runpod: Callable[..., Scheduler],
    runpod: RunPodEmulator,
    api: str,
) -> None:
    sched = on_runpod(api)
    alive = runpod_workers(runpod, sched)
    with guarded_leases(sched, "runpod", alive, runpod_stops(runpod), gpu="mid") as guarded:
        assert alive(guarded.short["lease_id"]) and alive(guarded.long["lease_id"])
        sched.kill()
        guarded.only_the_expired_goes()
        guarded.back_and_coherent()
        assert KEY not in guarded.guard.log()


# --- what a scheduler records of its guards ----------------------------------------------

STATIC = {"PROVIDERS": "static", "STATIC_WORKERS": "renderer=http://w:8080"}


def poll(sched: Scheduler, guard_id: str, providers: str) -> httpx.Response:
    """A guard's poll, as `openalice-scheduler guard` sends it."""
    return sched.http.get("/v1/guard", params={"guard_id": guard_id, "providers": providers})


def listed(sched: Scheduler) -> list[str]:
    """The guards `GET /v1/providers` shows under the static provider, in its order."""
    [view] = sched.http.get("/v1/providers").json()
    return [seen["guard_id"] for seen in view["guards"]]


def series(sched: Scheduler) -> set[str]:
    """The guards with a series on /metrics."""
    text = HTTP.get(f"{sched.url}/metrics", timeout=10).text
    name = "scheduler_guard_last_contact_timestamp_seconds"
    return set(re.findall(rf'^{name}\{{guard="([^"]*)"\}} ', text, re.MULTILINE))


def test_only_guards_of_this_schedulers_providers_are_recorded_and_so_many(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """Regression: any guard_id with any providers was answered 200 and recorded, with
    a series on the ungated /metrics (a fuzz run left 568 rows, each one a future
    SchedulerGuardSilent alert), and `static,static,…` listed one guard once per
    repetition. Now a provider this scheduler does not run is a 422 naming it and the
    valid ones, the list is taken once, and past MAX_GUARDS a new guard is a 429 while
    the known ones go on polling."""
    sched = make_scheduler(**STATIC, MAX_GUARDS="3")
    for providers in ("runpod", "static,nope", "local-docker,static"):
        refused = poll(sched, f"stray-{uuid.uuid4().hex[:8]}", providers)
        assert refused.status_code == 422, (providers, refused.text)
        body = refused.json()
        assert (body["error"], body["field"]) == ("invalid_request", "providers"), body
        unknown = next(p for p in providers.split(",") if p != "static")
        assert f"'{unknown}'" in body["message"] and "static" in body["message"], body
    assert listed(sched) == [] and series(sched) == set()

    assert poll(sched, "g1", ",".join(["static"] * 36)).status_code == 200
    assert listed(sched) == ["g1"]
    for guard_id in ("g2", "g3"):
        assert poll(sched, guard_id, "static").status_code == 200
    full = poll(sched, "g4", "static")
    assert full.status_code == 429, full.text
    assert full.json()["error"] == "too_many_guards" and "MAX_GUARDS" in full.json()["message"]
    assert full.headers["Retry-After"].isdigit()
    assert poll(sched, "g1", "static").status_code == 200  # a known guard polls on
    assert listed(sched) == ["g1", "g2", "g3"]
    assert series(sched) == {"g1", "g2", "g3"}
    # A guard deployed for a provider this scheduler does not run says why, each poll.
    guard = GuardProcess(sched, PROVIDERS="local-docker").start()
    try:
        wait_for(
            lambda: "refused it: 422 providers: 'local-docker' is not a provider" in guard.log(),
            timeout=60,
            what="the guard logging its refusal",
        )
    finally:
        guard.kill()
    assert SECRET not in guard.log()


def test_a_silent_guard_is_forgotten_on_a_timer_with_its_series(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """A guard silent for GUARD_FORGET_SECONDS is forgotten by the scheduler's own
    timer, with no other guard polling meanwhile: gone from `GET /v1/providers` and from
    /metrics, and its room is free for a new guard."""
    sched = make_scheduler(**STATIC, MAX_GUARDS="1", GUARD_FORGET_SECONDS="2")
    assert poll(sched, "old", "static").status_code == 200
    assert listed(sched) == ["old"] and series(sched) == {"old"}
    assert poll(sched, "new", "static").status_code == 429
    wait_for(
        lambda: listed(sched) == [] and series(sched) == set(),
        timeout=30,
        interval=0.2,
        what="the silent guard forgotten",
    )
    assert poll(sched, "new", "static").status_code == 200
    assert listed(sched) == ["new"] and series(sched) == {"new"}


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
