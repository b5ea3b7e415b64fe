"""Issue 33 on RunPod, against the RunPod emulator (tests/runpod_emulator/, REST and
GraphQL): the scheduler as a process, each pod's endpoint the emulator's proxy URL
(RUNPOD_PROXY_URL), where the scheduler probes it too.

- Ready when handed out: a pod RunPod calls RUNNING, whose proxy URL still answers 502
  (nothing listens behind it), is answered only once the proxy answers for it, so the
  caller's first request succeeds; with no ready path, the proxy's own 502 is not taken
  for the worker's answer. (`test_ready.py` shows the same with a ready path,
  ANIM_READY_PATH=/healthz, and a pod that never answers.)
- A death after the hand-out ends the lease at the next reconcile pass: `released`,
  reason `lost`; a pod EXITED is `exited` (RunPod gives no exit code: null), one in
  ERROR or gone from RunPod's listing `unknown`; a renewal is a 409 `worker_lost`; the
  room is free at once (RUNPOD_MAX_PODS=1); the pod is terminated.
- Nothing ended by mistake: pods RUNNING, STARTING or PROVISIONING keep their leases
  across reconcile passes; a pod that exited while no scheduler ran ends its lease at
  the restart, the others kept."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.harness import HTTP, Scheduler, wait_for
from tests.loss import end_of, lease_now, lost, renewal_refused_as_lost
from tests.runpod_emulator import RunPodEmulator
from tests.test_modal_loss import EVERY_SECOND, reconcile_passes

KEY = "rpk-loss-" + uuid.uuid4().hex
Make = Callable[..., Scheduler]


@pytest.fixture
def runpod(runpod_server: RunPodEmulator) -> RunPodEmulator:
    runpod_server.reset()
    runpod_server.provision_delay = 0.3
    runpod_server.pods_answer_after = 0  # a pod's proxy URL answers once it runs
    return runpod_server


def on_runpod(make_scheduler: Make, runpod: RunPodEmulator, api: str, **env: str) -> Scheduler:
    settings = {
        "PROVIDERS": "runpod",
        "RUNPOD_API": api,
        "RUNPOD_API_KEY": KEY,
        "RUNPOD_API_BASE_URL": runpod.base_url,
        "RUNPOD_PROXY_URL": runpod.proxy_url,
        "RUNPOD_READY_TIMEOUT_SECONDS": "30",
        "RUNPOD_POLL_INTERVAL_SECONDS": "0.1",
        "RUNPOD_CATALOG_TTL_SECONDS": "0",
        **EVERY_SECOND,
    }
    return make_scheduler(**{**settings, **env})


def first_request(lease: dict[str, Any]) -> httpx.Response:
    """ONE request to the lease's endpoint, as a caller makes it once answered."""
    return HTTP.get(lease["endpoint"] + "/", timeout=10)


def pod_ids(runpod: RunPodEmulator) -> list[str]:
    return [pod.id for pod in runpod.list_pods()]


def terminated(runpod: RunPodEmulator, lease: dict[str, Any]) -> bool:
    """Whether the scheduler terminated the lease's pod (and RunPod has it no more)."""
    pod_id = lease["provider_token"]
    asked = any(call.pod_id == pod_id for call in runpod.calls("terminate"))
    return asked and pod_id not in pod_ids(runpod)


# --- ready when handed out -----------------------------------------------------------------


def test_a_pod_is_handed_out_once_its_proxy_url_answers_without_a_ready_path(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    runpod.pods_answer_after = 1.5  # RUNNING at once; its proxy answers 1.5 s later
    sched = on_runpod(make_scheduler, runpod, "rest", ANIM_READY_PATH="")
    lease = sched.lease(kind="anim", gpu="mid", ttl_seconds=300)
    answer = first_request(lease)
    assert answer.status_code == 200, answer.text
    assert answer.json()["pod_id"] == lease["provider_token"]
    assert runpod.proxy_hits(lease["provider_token"]) > 2  # probed, 502, probed again
    assert sched.metric("scheduler_ready_seconds_sum", provider="runpod") >= 1.5


def test_without_the_probe_the_first_request_meets_the_proxy_s_502(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    """The control of the test above: the same pod, not probed (0), is handed out once
    RunPod calls it RUNNING, and the caller's first request gets the proxy's 502. (Its
    proxy answers 30 s after RUNNING here, so that no load hides it.)"""
    runpod.pods_answer_after = 30
    sched = on_runpod(
        make_scheduler, runpod, "rest", ANIM_READY_PATH="", RUNPOD_READY_TIMEOUT_SECONDS="0"
    )
    lease = sched.lease(kind="anim", gpu="mid", ttl_seconds=300)
    assert first_request(lease).status_code == 502


# --- a death after the hand-out ---------------------------------------------------------


def test_an_exited_pod_ends_its_lease_frees_its_room_and_is_terminated(
    api: str, make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    sched = on_runpod(make_scheduler, runpod, api, RUNPOD_MAX_PODS="1")
    lease = sched.lease(kind="renderer", gpu="mid", ttl_seconds=300, owner_id="me")
    assert sched.acquire(kind="renderer", gpu="mid").status_code == 503  # RUNPOD_MAX_PODS

    runpod.set_pod_status(lease["provider_token"], "EXITED")
    lost(sched, lease, "exited", None)  # RunPod tells no exit code
    renewal_refused_as_lost(sched, lease, "exited", None)
    # The room is free at once; the pod is terminated, not left to bill.
    served = sched.acquire(kind="renderer", gpu="mid")
    assert served.status_code == 200, served.text
    wait_for(lambda: terminated(runpod, lease), 30, what="the pod terminated")
    assert pod_ids(runpod) == [served.json()["lease"]["provider_token"]]
    assert sched.metric("scheduler_workers_lost_total", provider="runpod", cause="exited") == 1
    assert sched.metric("scheduler_leases_released_total", provider="runpod", reason="lost") == 1


def test_a_pod_in_error_ends_its_lease_as_unknown(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    """REST only: GraphQL's pod has no such status (`desiredStatus` is intent; the
    emulator shows a pod in ERROR there as RUNNING without a runtime, as one starting)."""
    sched = on_runpod(make_scheduler, runpod, "rest")
    failed = sched.lease(kind="renderer", gpu="mid", ttl_seconds=300, owner_id="me")
    kept = sched.lease(kind="renderer", gpu="mid", ttl_seconds=300, owner_id="me")
    runpod.set_pod_status(failed["provider_token"], "ERROR")
    lost(sched, failed, "unknown", None)
    renewal_refused_as_lost(sched, failed, "unknown", None)
    wait_for(lambda: terminated(runpod, failed), 30, what="the pod terminated")
    assert lease_now(sched, kept)["state"] == "active"
    assert pod_ids(runpod) == [kept["provider_token"]]
    assert sched.metric("scheduler_workers_lost_total", provider="runpod", cause="unknown") == 1


def test_a_pod_gone_from_runpod_ends_its_lease_as_unknown(
    api: str, make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    sched = on_runpod(make_scheduler, runpod, api, RUNPOD_MAX_PODS="1")
    lease = sched.lease(kind="renderer", gpu="mid", ttl_seconds=300, owner_id="me")
    assert runpod.vanish_pod(lease["provider_token"])  # RunPod reclaimed it
    lost(sched, lease, "unknown", None)
    renewal_refused_as_lost(sched, lease, "unknown", None)
    assert sched.acquire(kind="renderer", gpu="mid").status_code == 200  # its room is free
    assert sched.metric("scheduler_workers_lost_total", provider="runpod", cause="unknown") == 1


# --- nothing ended by mistake --------------------------------------------------------------


def test_pods_running_starting_or_provisioning_keep_their_leases(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    sched = on_runpod(make_scheduler, runpod, "rest")
    leases = [sched.lease(kind="renderer", gpu="mid", ttl_seconds=300) for _ in range(3)]
    running, starting, provisioning = leases
    # RunPod lists a pod that runs as STARTING or PROVISIONING again (a restart on its
    # host, say): not a death.
    runpod.set_pod_status(starting["provider_token"], "STARTING")
    runpod.set_pod_status(provisioning["provider_token"], "PROVISIONING")
    reconcile_passes(sched, 4)
    for lease in leases:
        assert lease_now(sched, lease)["state"] == "active", lease
    assert sorted(pod_ids(runpod)) == sorted(lease["provider_token"] for lease in leases)
    assert runpod.call_count("terminate") == 0
    assert first_request(running).status_code == 200
    assert sched.metric("scheduler_leases_released_total", provider="runpod", reason="lost") == 0


def test_a_pod_that_exited_while_the_scheduler_was_down_ends_its_lease_at_start_up(
    api: str, make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    sched = on_runpod(make_scheduler, runpod, api)
    doomed = sched.lease(kind="renderer", gpu="mid", ttl_seconds=300)
    healthy = sched.lease(kind="renderer", gpu="mid", ttl_seconds=300)
    sched.kill()
    runpod.set_pod_status(doomed["provider_token"], "EXITED")
    sched.start()  # start-up reconciliation runs before the first request is served
    assert end_of(lease_now(sched, doomed)) == ("released", "lost", "exited", None)
    assert terminated(runpod, doomed)
    assert lease_now(sched, healthy)["state"] == "active"
    assert pod_ids(runpod) == [healthy["provider_token"]]
