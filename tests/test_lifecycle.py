"""A lease's whole life as the service runs it: expiry, reconciliation with Docker,
restarts (graceful and SIGKILL) and refusing to start when misconfigured. Real service
processes, real Docker."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import docker
import httpx

from tests.harness import (
    HTTP,
    INSTANCE_LABEL,
    WORKER_IMAGE,
    Scheduler,
    docker_client,
    engine_events,
    free_port,
    printed_lines,
    run_serve,
    wait_for,
)
from tests.procs import children

LEASE_LABEL = "openalice.scheduler.lease_id"
STORE_LABEL = "openalice.scheduler.store"
RELEASED = "scheduler_leases_released_total"
# Set at the end of each reconcile pass (loops/reconciler.py): the pass counter tests wait on.
RECONCILED = "scheduler_reconcile_last_success_timestamp_seconds"
# What the engine says of a container told to stop, or stopping, in its event stream.
STOPPING = frozenset({"kill", "die", "stop", "destroy"})


def epoch(timestamp: str) -> float:
    return datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


def listed_ids(sched: Scheduler) -> set[str]:
    return {lease["lease_id"] for lease in sched.leases()}


def passes(sched: Scheduler, n: int, gauge: str = RECONCILED, timeout: float = 60) -> None:
    """Wait for `n` more passes of the loop whose `gauge` (unix time) is set at the end of
    each pass: each ends after the last, so the last n - 1 run wholly from now on."""
    last = time.time()
    for i in range(n):
        last = wait_for(
            lambda last=last: (stamp := sched.metric(gauge)) > last and stamp,
            timeout,
            interval=0.1,
            what=f"{gauge} to move past {last} (pass {i + 1} of {n})",
        )


@contextlib.contextmanager
def container_stops(instance: str) -> Iterator[dict[str, float]]:
    """While the block runs: when each container of `instance` was first told to stop or
    stopped (unix time of its first kill, die, stop or destroy event), by its lease id,
    as the engine's event stream tells it. The engine's own clock: a later look cannot
    be fooled by a slow test, and its event buffer (256) is not relied on."""
    first: dict[str, float] = {}

    def heard(event: dict[str, Any]) -> None:
        lease_id = event.get("Actor", {}).get("Attributes", {}).get(LEASE_LABEL)
        if event.get("Action") in STOPPING and lease_id:
            first.setdefault(lease_id, event["timeNano"] / 1e9)

    label = f"{INSTANCE_LABEL}={instance}"
    with engine_events({"type": "container", "label": label}, heard):
        yield first


# --- expiry ----------------------------------------------------------------------------


def test_lease_expires_on_time_without_waiting_for_the_sweep_interval(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    # SWEEP_INTERVAL_SECONDS stays at its default (30 s): only waking at the expiry
    # itself can make this in time.
    sched = make_scheduler()
    assert "SWEEP_INTERVAL_SECONDS" not in sched.env
    keeper = sched.lease(ttl_seconds=600)
    with container_stops(sched.instance) as stops:
        # 6 s: its worker's start (counted in the TTL) leaves it a few seconds, on a
        # loaded machine too.
        lease = sched.lease(ttl_seconds=6)
        expires = epoch(lease["expires_at"])
        assert 5.5 < expires - epoch(lease["created_at"]) <= 6.0 + 1e-6

        def gone() -> bool:
            return (
                lease["lease_id"] not in listed_ids(sched)
                and {c.id for c in sched.containers()} == {keeper["provider_token"]}
                and sched.metric(RELEASED, provider="local-docker", reason="expired") == 1
            )

        wait_for(gone, timeout=60, interval=0.05, what="the expired lease to be released")
        lag = time.time() - expires  # upper bound: includes the last check's own duration
        print(f"\nexpiry lag: lease gone {lag:.3f} s after expires_at")
        wait_for(lambda: lease["lease_id"] in stops, 30, what="the engine's word of its stop")
    # Not cut short: its worker ran, and its lease held, until it was due (the engine's
    # and the store's times of it).
    assert stops[lease["lease_id"]] >= expires, (stops, expires)
    released = sched.http.get(f"/v1/lease/{lease['lease_id']}").json()
    assert released["state"] == "released" and epoch(released["released_at"]) >= expires
    assert keeper["lease_id"] not in stops
    # Its release (a container stopped and removed) well before the 30 s sweep interval;
    # on an idle machine within a second.
    assert lag <= 10, f"lease released {lag:.2f} s after expires_at (the interval is 30 s)"
    assert sched.release(lease["lease_id"]).status_code == 404
    assert listed_ids(sched) == {keeper["lease_id"]}
    assert sched.metric("scheduler_active_leases") == 1


# --- reconciliation --------------------------------------------------------------------


def test_periodic_reconcile_destroys_orphans_and_marks_vanished_workers_lost(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler(RECONCILE_INTERVAL_SECONDS="1")
    kept = sched.lease(ttl_seconds=600)
    doomed = sched.lease(ttl_seconds=600)
    client = docker_client()

    orphan_id = str(uuid.uuid4())
    orphan = client.containers.create(
        WORKER_IMAGE,
        network_mode="none",
        labels={INSTANCE_LABEL: sched.instance, LEASE_LABEL: orphan_id},
    )
    # A reconcile pass (one a second) may destroy it between its creation and its start:
    # then the start finds nothing (404), or finds it being removed (409, "marked for
    # removal", seen on a loaded machine), and the orphan is gone all the same.
    try:
        orphan.start()
    except docker.errors.APIError as exc:
        if exc.status_code not in (404, 409):
            raise
    # Another scheduler's worker is none of this one's business.
    other_instance = f"t-other-{uuid.uuid4().hex[:8]}"
    foreign = client.containers.run(
        WORKER_IMAGE,
        detach=True,
        network_mode="none",
        labels={INSTANCE_LABEL: other_instance, LEASE_LABEL: str(uuid.uuid4())},
    )
    try:

        def orphan_gone() -> bool:
            return orphan.id not in {c.id for c in sched.containers()}

        wait_for(orphan_gone, timeout=30, interval=0.2, what="the orphan to be destroyed")
        assert sched.metric(RELEASED, provider="local-docker", reason="orphan") == 1

        # Someone removes a leased worker by hand: the lease is lost, not kept alive.
        client.api.remove_container(doomed["provider_token"], force=True)
        wait_for(
            lambda: doomed["lease_id"] not in listed_ids(sched),
            timeout=30,
            interval=0.2,
            what="the lease of the vanished worker to be dropped",
        )
        assert sched.metric(RELEASED, provider="local-docker", reason="lost") == 1
        assert sched.release(doomed["lease_id"]).status_code == 404

        # The healthy lease and the other instance's container are untouched.
        passes(sched, 3)  # at least two more reconcile passes, wholly from now on
        assert listed_ids(sched) == {kept["lease_id"]}
        assert [c.id for c in sched.containers(all=False)] == [kept["provider_token"]]
        foreign.reload()
        assert foreign.status == "running"
        assert sched.metric(RELEASED, provider="local-docker", reason="orphan") == 1
        assert sched.metric(RELEASED, provider="local-docker", reason="lost") == 1
    finally:
        foreign.remove(force=True)
        with contextlib.suppress(docker.errors.NotFound):  # destroyed, as it should be
            orphan.remove(force=True)


def test_schedulers_sharing_an_instance_name_but_not_a_store_leave_each_others_workers(
    make_scheduler: Callable[..., Scheduler],
    tmp_path: Path,
) -> None:
    """Two schedulers with one SCHEDULER_INSTANCE (the default is `default` for everyone)
    and their own databases: each worker carries its store's id, so neither destroys the
    other's workers as orphans; an unlabelled worker (made before the label) is still
    taken for this instance's."""
    instance = f"t-shared-{uuid.uuid4().hex[:8]}"
    first = make_scheduler(
        SCHEDULER_INSTANCE=instance,
        RECONCILE_INTERVAL_SECONDS="1",
        DATABASE_URL=f"sqlite:///{tmp_path / 'first.db'}",
    )
    second = make_scheduler(
        SCHEDULER_INSTANCE=instance,
        RECONCILE_INTERVAL_SECONDS="1",
        DATABASE_URL=f"sqlite:///{tmp_path / 'second.db'}",
    )
    leases = [first.lease(ttl_seconds=600), second.lease(ttl_seconds=600)]
    labels = {c.id: c.labels for c in first.containers()}
    stores = {labels[lease["provider_token"]].get(STORE_LABEL) for lease in leases}
    assert len(stores) == 2 and None not in stores, labels

    unlabelled = docker_client().containers.create(
        WORKER_IMAGE,
        network_mode="none",
        labels={INSTANCE_LABEL: instance, LEASE_LABEL: str(uuid.uuid4())},
    )
    try:
        try:
            unlabelled.start()
        except docker.errors.APIError as exc:
            # A reconcile pass (every 1 s) may take the orphan between its create and its
            # start: the engine then refuses the start (409, marked for removal; or 404).
            if exc.status_code not in (404, 409):
                raise
        wait_for(
            lambda: unlabelled.id not in {c.id for c in first.containers()},
            timeout=30,
            interval=0.2,
            what="the unlabelled orphan to be destroyed",
        )
        for sched in (first, second):
            passes(sched, 3)  # at least two more passes of each, wholly from now on
        for sched, lease in zip((first, second), leases, strict=True):
            assert listed_ids(sched) == {lease["lease_id"]}
            assert sched.metric(RELEASED, provider="local-docker", reason="lost") == 0
        running = {c.id for c in first.containers(all=False)}
        assert running == {lease["provider_token"] for lease in leases}
        assert "belong to another state store" in first.log() + second.log()
    finally:
        with contextlib.suppress(docker.errors.NotFound):  # destroyed, as it should be
            unlabelled.remove(force=True)


def test_lease_that_expired_while_the_service_was_down_is_released_at_start_up(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler()
    survivor = sched.lease(ttl_seconds=600)
    lease = sched.lease(ttl_seconds=6)  # its worker's start counted: a few seconds left
    sched.kill()  # SIGKILL: no shutdown code runs

    expires = epoch(lease["expires_at"])
    # sleep: the service is dead (killed) so that nothing acts at the expiry; only the
    # wall clock can pass it, and nothing running observes that moment.
    time.sleep(max(0.0, expires + 1.0 - time.time()))
    # Nobody released it meanwhile: its worker is still there.
    assert lease["provider_token"] in {c.id for c in sched.containers()}

    sched.start()  # same database, same port, same instance
    # Start-up reconciliation runs before the service answers: the first look finds
    # the expired lease already released and its worker gone.
    assert listed_ids(sched) == {survivor["lease_id"]}
    assert {c.id for c in sched.containers()} == {survivor["provider_token"]}
    assert sched.metric(RELEASED, provider="local-docker", reason="expired") == 1
    assert sched.release(lease["lease_id"]).status_code == 404
    assert sched.release(survivor["lease_id"]).status_code == 204
    assert sched.containers() == []


def test_graceful_stop_keeps_leases_and_workers_and_a_restart_lists_them(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler(RECONCILE_INTERVAL_SECONDS="1")
    leases = [
        sched.lease(kind="renderer", ttl_seconds=600),
        sched.lease(kind="anim", owner_id="anim-service", ttl_seconds=600),
    ]
    tokens = {lease["provider_token"] for lease in leases}

    sched.stop()  # SIGTERM
    # A clean shutdown; uvicorn then re-raises the SIGTERM it caught, hence -15.
    assert sched.proc is not None and sched.proc.returncode in (0, -15), sched.log()[-2000:]
    assert "Application shutdown complete" in sched.log()
    assert {c.id for c in sched.containers(all=False)} == tokens, "workers keep running"

    sched.start()
    assert sorted(sched.leases(), key=lambda x: x["created_at"]) == leases
    passes(sched, 3)  # reconcile passes after the restart change nothing
    assert sorted(sched.leases(), key=lambda x: x["created_at"]) == leases
    assert {c.id for c in sched.containers(all=False)} == tokens
    assert sched.metric("scheduler_active_leases") == 2

    # And the restarted service still owns them: it can release them.
    assert sched.release(leases[0]["lease_id"]).status_code == 204
    assert sched.release(leases[1]["lease_id"], owner="anim-service").status_code == 204
    assert sched.containers() == []


# --- refusing to start -----------------------------------------------------------------


def serve(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m openalice_scheduler serve` with exactly `env` (plus PATH/HOME)."""
    full = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    return run_serve(full, tmp_path)


def startable(tmp_path: Path, **env: str) -> dict[str, str]:
    """A configuration `serve` starts with (a secret, port, instance and SQLite file of
    its own), `env` on top: what each bad-setting case changes one variable of."""
    return {
        "INTERNAL_SECRET": "cfg-secret-" + uuid.uuid4().hex,
        "SCHEDULER_HOST": "127.0.0.1",
        "SCHEDULER_PORT": str(free_port()),
        "SCHEDULER_INSTANCE": f"t-cfg-{uuid.uuid4().hex[:8]}",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'cfg.db'}",
        **env,
    }


def test_bad_configuration_stops_start_up_with_one_line_naming_the_variable(
    tmp_path: Path,
) -> None:
    valid = startable(
        tmp_path, DOCKER_NETWORK=f"oa-cfg-{uuid.uuid4().hex[:8]}", LOCAL_GPU_DEVICES=""
    )
    secret = valid["INTERNAL_SECRET"]
    # A kubeconfig that reads well, with one context: `K8S_CONTEXT=nope` names none.
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: here\n"
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: here, context: {cluster: c, user: u}}]\n"
    )
    garbled = tmp_path / "garbled-kubeconfig"
    garbled.write_text("clusters: [unclosed\n")
    cases: list[tuple[str, dict[str, str | None], list[str]]] = [
        ("INTERNAL_SECRET", {"INTERNAL_SECRET": None}, []),
        ("INTERNAL_SECRET", {"INTERNAL_SECRET": ""}, []),
        ("INTERNAL_SECRET", {"INTERNAL_SECRET": "   "}, []),
        ("PROVIDERS", {"PROVIDERS": "bogus"}, ["bogus"]),
        ("PROVIDERS", {"PROVIDERS": ""}, []),
        ("PROVIDERS", {"PROVIDERS": "runpod"}, ["RUNPOD_API_KEY"]),
        ("PROVIDERS", {"PROVIDERS": "runpod", "RUNPOD_API_KEY": ""}, ["RUNPOD_API_KEY"]),
        ("PROVIDERS", {"PROVIDERS": "modal", "MODAL_TOKEN_ID": "ak-1"}, ["MODAL_TOKEN_SECRET"]),
        ("MODAL_GPU_TYPES", {"MODAL_GPU_TYPES": "entry:L4"}, ["'entry:L4'"]),
        ("MODAL_SANDBOX_TIMEOUT_SECONDS", {"MODAL_SANDBOX_TIMEOUT_SECONDS": "90000"}, []),
        ("PROVIDERS", {"PROVIDERS": "kubernetes"}, ["KUBECONFIG"]),
        ("K8S_GPU_CLASSES", {"K8S_GPU_CLASSES": "entry=nvidia.com/gpu"}, ["resource:count"]),
        ("K8S_NAMESPACE", {"K8S_NAMESPACE": "Not_A_Name"}, ["'Not_A_Name'"]),
        ("K8S_POD_DEADLINE_SECONDS", {"K8S_POD_DEADLINE_SECONDS": "10"}, []),
        (
            "KUBECONFIG",
            {"PROVIDERS": "kubernetes", "KUBECONFIG": str(tmp_path / "no-such-kubeconfig")},
            ["no-such-kubeconfig"],
        ),
        (
            "KUBECONFIG",
            {"PROVIDERS": "kubernetes", "KUBECONFIG": str(garbled)},
            ["not a readable kubeconfig", "ParserError"],
        ),
        (
            "K8S_CONTEXT",
            {"PROVIDERS": "kubernetes", "KUBECONFIG": str(kubeconfig), "K8S_CONTEXT": "nope"},
            ["'nope'"],
        ),
        ("SCHEDULER_PORT", {"SCHEDULER_PORT": "x"}, []),
        ("LOCAL_DOCKER_MAX_WORKERS", {"LOCAL_DOCKER_MAX_WORKERS": "-1"}, []),
        # A check across variables (the model's own validator) names the variable once.
        ("LOCAL_GPU_DEVICES", {"LOCAL_GPU_DEVICES": "0;1"}, ["'0;1'"]),
    ]
    for variable, change, also in cases:
        env = dict(valid)
        for key, value in change.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        result = serve(tmp_path, {k: v for k, v in env.items() if v is not None})
        lines = printed_lines(result.stderr)
        assert result.returncode != 0, (change, result.stderr)
        assert len(lines) == 1, (change, result.stderr)
        assert variable in lines[0], (change, lines)
        assert lines[0].count("configuration:") == 1, (change, lines)
        for word in also:
            assert word in lines[0], (change, lines)
        assert "Traceback" not in result.stderr and secret not in result.stderr
        assert result.stdout == "", (change, result.stdout)
    assert not (tmp_path / "cfg.db").exists(), "nothing is created by a refused start"


def test_runpod_without_key_is_skipped_with_a_warning_when_another_provider_remains(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    sched = make_scheduler(PROVIDERS="local-docker,runpod")
    assert "RUNPOD_API_KEY" in sched.log()
    assert sched.metric("scheduler_providers") == 1
    assert sched.lease()["provider"] == "local-docker"


def test_second_process_on_the_same_sqlite_file_refuses_to_start(
    make_scheduler: Callable[..., Scheduler],
    tmp_path: Path,
) -> None:
    first = make_scheduler()
    lease = first.lease(ttl_seconds=600)

    result = serve(tmp_path, {**first.env, "SCHEDULER_PORT": str(free_port())})
    lines = printed_lines(result.stderr)
    assert result.returncode != 0, result.stderr
    assert len(lines) == 1, result.stderr
    assert "DATABASE_URL" in lines[0] and "another scheduler process" in lines[0], lines
    assert "Traceback" not in result.stderr

    # The first one never noticed.
    assert HTTP.get(f"{first.url}/health").status_code == 200
    assert listed_ids(first) == {lease["lease_id"]}
    assert [c.id for c in first.containers()] == [lease["provider_token"]]


def test_a_lease_answered_before_kill_9_is_there_after_the_restart(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """A lease is answered once SQLite's own FULL commit returned: killed right after
    the answer, the scheduler finds it on restart. No helper process runs beside it."""
    sched = make_scheduler(
        PROVIDERS="static", STATIC_WORKERS="renderer=http://a:8080,http://b:8080"
    )
    assert sched.proc is not None
    first = sched.lease(ttl_seconds=600)
    assert children(sched.proc.pid) == []
    sched.kill()
    sched.start()
    assert listed_ids(sched) == {first["lease_id"]}
    second = sched.lease(ttl_seconds=600)
    assert second["lease_id"] != first["lease_id"]
    assert second["endpoint"] != first["endpoint"]  # the first still holds its endpoint


def test_another_process_holding_the_sqlite_write_lock_stalls_no_one(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    """A tool writing to the state file (an operator's sqlite3 shell, a script) holds its
    write lock: writes wait for it, while health, metrics and reads go on answering; once
    it lets go, the waiting acquire completes."""
    sched = make_scheduler(
        PROVIDERS="static", STATIC_WORKERS="renderer=http://a:8080,http://b:8080"
    )
    kept = sched.lease(ttl_seconds=600)
    path = sched.env["DATABASE_URL"].removeprefix("sqlite:///")
    tool = sqlite3.connect(path, isolation_level=None)
    tool.execute("BEGIN IMMEDIATE")  # the write lock, held
    answers: list[httpx.Response] = []
    caller = threading.Thread(
        target=lambda: answers.append(
            HTTP.post(
                f"{sched.url}/v1/lease",
                headers=sched.http.headers,
                timeout=60,
                json={"kind": "renderer", "owner_id": "waits-for-the-lock"},
            )
        )
    )
    try:
        caller.start()
        # sleep: the acquire is waiting for the lock by now. Nothing tells when it is
        # (no log line or metric while a write waits for SQLite's lock); were it late, the
        # checks below would still hold, only proving less.
        time.sleep(0.5)
        assert not answers
        for path_ in ("/health", "/metrics", "/v1/leases"):
            response = HTTP.get(f"{sched.url}{path_}", headers=sched.http.headers, timeout=5)
            assert response.status_code == 200, (path_, response.text)
        assert [lease["lease_id"] for lease in sched.leases()] == [kept["lease_id"]]
        assert caller.is_alive() and not answers
    finally:
        tool.execute("ROLLBACK")
        tool.close()
        caller.join(60)
    assert [response.status_code for response in answers] == [200], answers[0].text
    waited = answers[0].json()["lease"]
    assert waited["endpoint"] == "http://b:8080"
    assert sorted(lease["lease_id"] for lease in sched.leases()) == sorted(
        [kept["lease_id"], waited["lease_id"]]
    )
