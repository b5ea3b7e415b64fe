"""Issue 33 on Modal, against the Modal emulator (tests/modal_emulator/): the scheduler as a
process, each sandbox a real container of the demo worker behind a real TLS tunnel.

- Ready when handed out: a sandbox whose worker listens only some seconds after it runs
  is answered only once the scheduler's own probe got through its tunnel, so the
  caller's very first request succeeds (and without the probe it does not); a sandbox
  Modal queues for capacity is answered only once it runs and answers.
- A death after the hand-out ends the lease at the next reconcile pass: `released`,
  reason `lost`, `lost_cause` and `exit_code` from the return code, all the client tells
  (a worker that exits with 3: `exited` 3; the sandbox's `timeout`: `deadline` 124); a
  renewal is a 409 `worker_lost`; the room is free at once; the sandbox is terminated.
  An OOM kill is not tested here: the provider gives its sandboxes no memory limit, and
  the emulator (as Modal) OOM-kills only a sandbox that has one; were it given one, the
  client would read it as `exited` 137 anyway, as a terminate.
- Nothing ended by mistake: a healthy lease stays `active` across reconcile passes, and
  a death while no scheduler ran ends its lease at the restart, the others kept."""

from __future__ import annotations

import contextlib
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.harness import Scheduler, wait_for
from tests.loss import end_of, lease_now, lost, renewal_refused_as_lost
from tests.modal_emulator import ModalEmulator
from tests.test_modal_provider import asked, on_modal

Make = Callable[..., Scheduler]
# Each reconcile pass a second after the last: a death is noticed within moments.
EVERY_SECOND = {"RECONCILE_INTERVAL_SECONDS": "1"}
RECONCILED = "scheduler_reconcile_last_success_timestamp_seconds"


@pytest.fixture
def modal(modal_server: ModalEmulator) -> ModalEmulator:
    modal_server.reset()  # no sandbox, switch or frozen clock of an earlier test
    return modal_server


# --- what a caller sees ------------------------------------------------------------------


def first_request(lease: dict[str, Any], emulator: ModalEmulator) -> str:
    """ONE request to the lease's endpoint, through its tunnel, as a caller makes it right
    after its acquire was answered (`page_of` tries again; a caller need not): "answered"
    when the worker answered with its own page, else what was seen instead."""
    trust = ssl.create_default_context(cafile=emulator.ca_file)
    try:
        response = httpx.get(lease["endpoint"] + "/", verify=trust, timeout=10)
    except httpx.TransportError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code != 200:
        return f"{response.status_code}: {response.text[:200]}"
    page = response.json()
    assert page["lease_id"] == lease["lease_id"], page
    return "answered"


def exit_worker(lease: dict[str, Any], emulator: ModalEmulator, code: int) -> dict[str, Any]:
    """The worker exits with `code` (`GET /cgi-bin/exit?<code>` through its tunnel), as a
    worker that crashes; the sandbox as Modal ended it."""
    trust = ssl.create_default_context(cafile=emulator.ca_file)

    def ended() -> dict[str, Any] | None:
        sandbox = asked(emulator, lease)
        if sandbox["state"] == "ended":
            return sandbox
        # Asked again until it ends: once asked, the worker listens no more.
        with contextlib.suppress(httpx.TransportError):
            httpx.get(f"{lease['endpoint']}/cgi-bin/exit?{code}", verify=trust, timeout=10)
        return None

    return dict(wait_for(ended, 60, interval=0.5, what=f"the worker to exit with {code}"))


def terminated_by_scheduler(emulator: ModalEmulator, lease: dict[str, Any]) -> bool:
    """Whether the scheduler asked Modal to terminate the lease's sandbox."""
    return any(
        call["rpc"].startswith("SandboxTerminate")
        and call["sandbox_id"] == lease["provider_token"]
        and call["status"] == "OK"
        for call in emulator.calls()
    )


def reconcile_passes(sched: Scheduler, count: int) -> None:
    """Returns once `count` reconcile passes finished after the call (the first of them
    may have listed before it: wait for one more than the passes that must judge)."""
    before = sched.metric(RECONCILED)
    seen: set[float] = set()

    def enough() -> bool:
        last = sched.metric(RECONCILED)
        if last > before:
            seen.add(last)
        return len(seen) >= count

    wait_for(enough, 60, interval=0.2, what=f"{count} reconcile passes")


# --- ready when handed out -----------------------------------------------------------------


def test_a_sandbox_slow_to_listen_is_handed_out_only_once_it_answers(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    # No ready path (empty is unset): behind the tunnel, any answer of the worker's own.
    sched = on_modal(make_scheduler, modal, RENDERER_READY_PATH="")
    started = time.monotonic()
    lease = sched.lease(kind="renderer", ttl_seconds=300, env={"LISTEN_DELAY_SECONDS": "3"})
    took = time.monotonic() - started
    # The sandbox ran at once; its worker listened 3 s later, and only then was it given.
    assert first_request(lease, modal) == "answered"
    assert took >= 3, f"answered after {took:.2f} s, before the worker listened"
    assert asked(modal, lease)["state"] == "running"
    assert "LISTEN_DELAY_SECONDS" in asked(modal, lease)["env_keys"]
    assert sched.metric("scheduler_ready_seconds_count", provider="modal") == 1
    assert sched.metric("scheduler_ready_seconds_sum", provider="modal") >= 3


def test_without_the_probe_the_first_request_through_the_tunnel_fails(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    """The control of the test above: the same worker, not probed (0), is handed out as
    soon as its sandbox runs, and the caller's first request finds nothing listening
    (the tunnel closes the connection). Its worker waits longer here (20 s) only so that
    no load on the machine can make the hand-out late enough to hide it."""
    sched = on_modal(make_scheduler, modal, RENDERER_READY_PATH="", MODAL_READY_TIMEOUT_SECONDS="0")
    lease = sched.lease(kind="renderer", ttl_seconds=300, env={"LISTEN_DELAY_SECONDS": "20"})
    assert first_request(lease, modal) != "answered"
    assert asked(modal, lease)["state"] == "running"


def test_a_sandbox_modal_queues_is_handed_out_once_it_runs_and_answers(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, RENDERER_READY_PATH="", **EVERY_SECOND)
    modal.set_max_sandboxes(1)  # Modal's capacity, not the scheduler's cap
    first = sched.lease(kind="renderer", ttl_seconds=300, owner_id="me")
    answered: list[tuple[float, httpx.Response]] = []

    def acquire() -> None:
        response = sched.acquire(
            kind="renderer", ttl_seconds=300, env={"LISTEN_DELAY_SECONDS": "2"}
        )
        answered.append((time.monotonic(), response))

    caller = threading.Thread(target=acquire, daemon=True)
    caller.start()
    # Modal took the create and queued its sandbox: no task, no container.
    queued = wait_for(
        lambda: [s for s in modal.sandboxes() if s["sandbox_id"] != first["provider_token"]],
        30,
        what="the second sandbox to be asked for",
    )[0]
    assert queued["queued"] and queued["state"] == "pending", queued
    # While it stays queued (two reconcile passes), the caller has no answer.
    reconcile_passes(sched, 2)
    assert modal.sandbox(queued["sandbox_id"])["queued"]
    assert not answered, answered[0][1].text
    [waiting] = sched.http.get("/v1/leases", params={"state": "provisioning"}).json()
    assert waiting["provider"] == "modal"

    # The first lease goes (well within the client's 50 s wait for tunnels): the queued
    # sandbox takes its place, runs, and is handed out once its worker answers.
    released_at = time.monotonic()
    assert sched.release(first["lease_id"], owner="me").status_code == 204
    caller.join(60)
    assert answered, "the second acquire was never answered"
    at, response = answered[0]
    assert response.status_code == 200, response.text
    assert at > released_at
    second = response.json()["lease"]
    assert second["provider_token"] == queued["sandbox_id"]
    assert first_request(second, modal) == "answered"
    running = asked(modal, second)
    assert running["state"] == "running" and not running["queued"]
    assert running["started_at"] >= asked(modal, first)["ended_at"]
    assert lease_now(sched, second)["state"] == "active"


# --- a death after the hand-out ---------------------------------------------------------


def test_a_sandbox_that_exits_ends_its_lease_and_frees_its_room(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, MODAL_MAX_SANDBOXES="1", **EVERY_SECOND)
    lease = sched.lease(kind="renderer", ttl_seconds=300, owner_id="me")
    assert sched.acquire(kind="renderer").status_code == 503  # at MODAL_MAX_SANDBOXES

    sandbox = exit_worker(lease, modal, 3)
    assert sandbox["result"]["returncode"] == 3  # Modal lists it no more
    lost(sched, lease, "exited", 3)
    # The caller hears it at its renewal: refused, saying why.
    renewal_refused_as_lost(sched, lease, "exited", 3)
    # The room is free at once; what remains of the sandbox is terminated.
    assert sched.acquire(kind="renderer").status_code == 200
    wait_for(lambda: terminated_by_scheduler(modal, lease), 30, what="the sandbox terminated")
    assert asked(modal, lease)["result"]["returncode"] == 3  # its own end, kept
    assert sched.metric("scheduler_workers_lost_total", provider="modal", cause="exited") == 1
    assert sched.metric("scheduler_leases_released_total", provider="modal", reason="lost") == 1


def test_a_sandbox_ended_at_its_timeout_ends_its_lease_as_deadline(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    modal.freeze_clock()  # only advance_clock moves Modal's clock: its deadline is exact
    sched = on_modal(make_scheduler, modal, MODAL_SANDBOX_TIMEOUT_SECONDS="120", **EVERY_SECOND)
    lease = sched.lease(kind="renderer", ttl_seconds=60, owner_id="me")
    assert modal.advance_clock(119) == []  # a second before its deadline: it runs on
    reconcile_passes(sched, 2)
    assert lease_now(sched, lease)["state"] == "active"

    assert modal.advance_clock(2) == [lease["provider_token"]]
    lost(sched, lease, "deadline", 124)
    renewal_refused_as_lost(sched, lease, "deadline", 124)
    assert asked(modal, lease)["result"]["status"] == "TIMEOUT"
    assert sched.metric("scheduler_workers_lost_total", provider="modal", cause="deadline") == 1


# --- nothing ended by mistake --------------------------------------------------------------


def test_a_healthy_sandbox_keeps_its_lease_across_reconcile_passes(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, **EVERY_SECOND)
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    reconcile_passes(sched, 4)
    assert lease_now(sched, lease)["state"] == "active"
    assert asked(modal, lease)["state"] == "running"
    assert first_request(lease, modal) == "answered"
    assert not terminated_by_scheduler(modal, lease)
    assert sched.metric("scheduler_leases_released_total", provider="modal", reason="lost") == 0


def test_a_death_while_the_scheduler_was_down_ends_that_lease_at_start_up(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal)
    doomed = sched.lease(kind="renderer", ttl_seconds=300)
    healthy = sched.lease(kind="renderer", ttl_seconds=300)
    sched.kill()
    exit_worker(doomed, modal, 5)
    sched.start()  # start-up reconciliation runs before the first request is served
    assert end_of(lease_now(sched, doomed)) == ("released", "lost", "exited", 5)
    assert lease_now(sched, healthy)["state"] == "active"
    assert asked(modal, healthy)["state"] == "running"
    assert sched.metric("scheduler_workers_lost_total", provider="modal", cause="exited") == 1
