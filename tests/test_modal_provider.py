"""Workers on Modal (issue 26), against the Modal emulator (tests/modal_emulator/): the
scheduler as a process with the official `modal` client pointed at the emulator, each
sandbox a real Docker container of the demo worker reached through its TLS tunnel."""

from __future__ import annotations

import ssl
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.harness import WORKER_IMAGE, Scheduler, wait_for
from tests.modal_emulator import ModalEmulator
from tests.test_guard import Alive, Stopped
from tests.test_k8s_provider import (
    bounded_by_the_worker_s_deadline,
    killed_mid_create,
    leased_with_a_scene,
    refuses_a_class_it_names_no_gpu_for,
    renewed_and_released,
    shows_its_cap_of_two,
    the_guard_alone_ends_only_the_expired,
)
from tests.test_priorities import PREEMPTING, anim_preempted_for_live
from tests.test_warm_pool import handed_over_warm, wait_idle

Make = Callable[..., Scheduler]
PRICES = {"none": 0.063, "entry": 0.86}


@pytest.fixture
def modal(modal_server: ModalEmulator) -> ModalEmulator:
    modal_server.reset()
    return modal_server


def on_modal(make_scheduler: Make, emulator: ModalEmulator, **env: str) -> Scheduler:
    settings = {
        **emulator.client_env(),
        "PROVIDERS": "modal",
        "MODAL_APP_NAME": f"oa-tests-{emulator.token_id[-6:]}",
        "MODAL_RENDERER_IMAGE": WORKER_IMAGE,
        "MODAL_ANIM_IMAGE": WORKER_IMAGE,
        "RENDERER_READY_PATH": "/healthz",
        "ANIM_READY_PATH": "/healthz",
    }
    return make_scheduler(**{**settings, **env})


def page_of(lease: dict[str, Any], emulator: ModalEmulator) -> dict[str, Any]:
    """The demo worker's page, fetched by the test through the lease's tunnel (the
    emulator's proxy, then the worker's busybox front). A connection closed unanswered
    on that way, seen once in a loaded full run and not in the scheduler's own calls,
    is tried again, for up to 5 s."""
    trust = ssl.create_default_context(cafile=emulator.ca_file)
    failed: list[httpx.TransportError] = []

    def fetch() -> dict[str, Any] | None:
        try:
            return dict(httpx.get(lease["endpoint"] + "/", verify=trust, timeout=10).json())
        except httpx.TransportError as exc:
            failed.append(exc)
            return None

    try:
        return dict(wait_for(fetch, 5, 0.25, what="the worker's page through its tunnel"))
    except AssertionError:
        raise AssertionError(f"the worker's page: {failed[-1]!r}") from failed[-1]


def asked(emulator: ModalEmulator, lease: dict[str, Any]) -> dict[str, Any]:
    """What the scheduler asked of Modal for `lease`'s sandbox."""
    return emulator.sandbox(lease["provider_token"])


def running_sandboxes(emulator: ModalEmulator) -> Alive:
    """Whether a lease id's sandbox runs, by the emulator's record."""

    def alive(lease_id: str) -> bool:
        return any(
            s["tags"].get("openalice_lease") == lease_id and s["state"] != "ended"
            for s in emulator.sandboxes()
        )

    return alive


def sandbox_ends(emulator: ModalEmulator) -> Stopped:
    """When the lease's sandbox ended, by the emulator's record."""

    def stopped(lease: dict[str, Any]) -> float | None:
        return next(
            (
                s["ended_at"]
                for s in emulator.sandboxes()
                if s["tags"].get("openalice_lease") == lease["lease_id"] and s["ended_at"]
            ),
            None,
        )

    return stopped


def test_a_lease_on_modal_is_a_sandbox_reached_through_its_tunnel(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, MODAL_SANDBOX_TIMEOUT_SECONDS="3600")
    lease = leased_with_a_scene(sched, "modal")
    assert lease["endpoint"].startswith("https://")
    assert lease["price_per_hour"] == PRICES["none"] and lease["gpu_type"] is None
    # The worker itself answers through the tunnel, with its lease.
    page = page_of(lease, modal)
    assert page["lease_id"] == lease["lease_id"] and page["fence"] == lease["fence"]

    sandbox = asked(modal, lease)
    assert sandbox["image"] == WORKER_IMAGE and sandbox["timeout_secs"] == 3600
    assert sandbox["gpu"] in (None, "")
    assert sandbox["tags"]["openalice_lease"] == lease["lease_id"]
    assert sandbox["tags"]["openalice_instance"] == sched.instance
    # The env went as a secret: its keys are the worker's, no value is on record.
    assert {"SCENE", "LEASE_ID", "LEASE_FENCE"} <= set(sandbox["env_keys"])
    assert "intro" not in str(modal.state())

    renewed_and_released(sched, lease)
    ended = asked(modal, lease)
    assert ended["state"] == "ended" and ended["result"]["returncode"] == 137


def test_each_gpu_class_asks_modal_for_its_gpu_type(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, MODAL_GPU_TYPES="entry=L4,mid=L40S")
    lease = sched.lease(kind="anim", gpu="entry", ttl_seconds=300)
    assert asked(modal, lease)["gpu"] == "L4"
    assert lease["gpu_type"] == "L4" and lease["price_per_hour"] == PRICES["entry"]
    refuses_a_class_it_names_no_gpu_for(sched, "MODAL_GPU_TYPES")
    assert sched.release(lease["lease_id"]).status_code == 204


def test_modal_ends_the_sandbox_at_its_deadline_with_no_scheduler_running(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, MODAL_SANDBOX_TIMEOUT_SECONDS="120")
    # A lease on Modal lives at most the sandbox's timeout.
    lease = bounded_by_the_worker_s_deadline(sched, "MODAL_SANDBOX_TIMEOUT_SECONDS")
    assert asked(modal, lease)["timeout_secs"] == 120

    sched.kill()  # no scheduler, and no guard runs
    assert asked(modal, lease)["state"] == "running"
    modal.advance_clock(121)
    ended = wait_for(
        lambda: (s := asked(modal, lease))["state"] == "ended" and s,
        30,
        what="Modal to end the sandbox at its deadline",
    )
    assert ended["result"]["returncode"] == 124  # Modal's own timeout


def test_no_capacity_on_modal_falls_over_to_docker(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, PROVIDERS="modal,local-docker")
    modal.set_no_capacity(True)
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert lease["provider"] == "local-docker"
    assert [s for s in modal.sandboxes() if s["state"] != "ended"] == []
    modal.set_no_capacity(False)
    on_modal_now = sched.lease(kind="renderer", ttl_seconds=300)
    assert on_modal_now["provider"] == "modal"


def test_the_modal_token_is_in_no_log_and_no_error(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    secret = modal.token_secret
    good = on_modal(make_scheduler, modal)
    lease = good.lease(kind="renderer", ttl_seconds=300)
    assert good.release(lease["lease_id"]).status_code == 204
    # A wrong secret: the acquire fails, naming the problem, and never the secret.
    wrong = on_modal(make_scheduler, modal, MODAL_TOKEN_SECRET="wrong-" + secret[::-1])
    failed = wrong.acquire(kind="renderer", ttl_seconds=300)
    assert failed.status_code in (502, 503), failed.text
    assert "modal" in failed.text.lower()
    for sched in (good, wrong):
        assert secret not in sched.log() and secret[::-1] not in sched.log()
    assert secret[::-1] not in failed.text
    providers = good.http.get("/v1/providers").text
    assert secret not in providers


def test_a_scheduler_killed_mid_create_leaves_no_sandbox_behind(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, RECONCILE_INTERVAL_SECONDS="1")
    modal.set_schedule_delay(4)  # the create waits for its container
    killed_mid_create(sched, lambda: modal.sandboxes(), "the sandbox to be asked for")
    modal.set_schedule_delay(0)
    sched.start()
    # The restarted scheduler resolves the lease it was making, and its sandbox goes.
    wait_for(
        lambda: all(s["state"] == "ended" for s in modal.sandboxes()),
        60,
        what="the half-made sandbox to be terminated",
    )
    leases = sched.http.get("/v1/leases", params={"state": ["failed", "released"]}).json()
    assert len(leases) == 1 and leases[0]["state"] == "failed"
    # One sandbox for the one lease, never two.
    assert len(modal.sandboxes()) == 1


def test_a_warm_pool_on_modal_hands_its_sandbox_over(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, WARM_POOL="renderer/none=1")
    # Handed over through the tunnel.
    lease = handed_over_warm(sched, lambda held: page_of(held, modal))
    assert lease["price_per_hour"] == PRICES["none"]
    # The pool makes another on Modal.
    wait_idle(sched, 1)


def test_modal_shows_in_providers_with_its_capacity(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, MODAL_MAX_SANDBOXES="2", MODAL_GPU_TYPES="entry=L4")
    shows_its_cap_of_two(sched, "modal")  # MODAL_MAX_SANDBOXES holds


def test_the_guard_ends_a_modal_sandbox_when_the_scheduler_is_dead(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal)
    the_guard_alone_ends_only_the_expired(
        sched, "modal", running_sandboxes(modal), sandbox_ends(modal)
    )
    # Terminated by the guard, well before Modal's own deadline.
    assert [s["result"]["returncode"] for s in modal.sandboxes() if s["state"] == "ended"] == [137]


def test_a_live_caller_preempts_an_anim_sandbox_on_modal(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, MODAL_MAX_SANDBOXES="1", **PREEMPTING)
    # Its worker is told through its tunnel before it goes.
    victim = anim_preempted_for_live(sched, "modal")
    assert asked(modal, victim)["state"] == "ended"


def test_a_transient_error_of_modal_is_retried_and_makes_one_sandbox(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal)
    modal.fail_next("SandboxCreate*", calls=2, per_attempt=True)
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    creates = [c for c in modal.calls() if c["rpc"].startswith("SandboxCreate")]
    assert [c["status"] for c in creates][:2] == ["UNAVAILABLE", "UNAVAILABLE"]
    assert creates[-1]["status"] == "OK"
    assert [s["sandbox_id"] for s in modal.sandboxes()] == [lease["provider_token"]]


def test_a_terminate_that_fails_once_is_retried_until_the_sandbox_is_gone(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, SWEEP_INTERVAL_SECONDS="1")
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    modal.fail_terminate_once()
    answer = sched.release(lease["lease_id"])
    assert answer.status_code in (204, 502), answer.text
    wait_for(
        lambda: sched.http.get(f"/v1/lease/{lease['lease_id']}").json()["state"] == "released",
        60,
        what="the release to be retried",
    )
    assert asked(modal, lease)["state"] == "ended"


def test_an_orphan_sandbox_of_this_scheduler_is_terminated_and_others_are_left(
    make_scheduler: Make, modal: ModalEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched = on_modal(make_scheduler, modal, RECONCILE_INTERVAL_SECONDS="1")
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    app_name = sched.env["MODAL_APP_NAME"]
    for key, value in modal.client_env().items():
        monkeypatch.setenv(key, value)
    import modal as modal_client  # the official client, as another program would use it

    with modal_client.Client.from_credentials(modal.token_id, modal.token_secret) as client:
        app = modal_client.App.lookup(app_name, client=client)
        image = modal_client.Image.from_registry(WORKER_IMAGE)

        def sandbox(instance: str) -> modal_client.Sandbox:
            """A sandbox of the worker with `instance`'s tag and a lease no store had."""
            tags = {"openalice_instance": instance, "openalice_lease": str(uuid.uuid4())}
            return modal_client.Sandbox.create(
                "/bin/sh", "/entry.sh", app=app, image=image, client=client, tags=tags
            )

        # A sandbox with this scheduler's tags and a lease its store never had, and one
        # of another instance, which is none of its business.
        orphan = sandbox(sched.instance)
        other = sandbox("someone-else")
    wait_for(
        lambda: modal.sandbox(orphan.object_id)["state"] == "ended",
        60,
        what="the orphan to be terminated",
    )
    assert modal.sandbox(other.object_id)["state"] == "running"
    assert asked(modal, lease)["state"] == "running"


def test_with_a_warm_pool_a_lease_on_modal_keeps_back_the_pool_s_idle_time(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    # A pool's sandbox is made before its lease: it may be a provision and the pool's
    # idle time older than the lease, so the lease's bound is that much shorter.
    sched = on_modal(
        make_scheduler,
        modal,
        WARM_POOL="renderer/none=1",
        MODAL_SANDBOX_TIMEOUT_SECONDS="1300",
        WARM_POOL_MAX_IDLE_SECONDS="100",
        PROVISION_TIMEOUT_SECONDS="100",
    )
    wait_idle(sched, 1)
    assert sched.acquire(kind="renderer", ttl_seconds=1200).status_code == 503
    lease = sched.lease(kind="renderer", ttl_seconds=600)
    assert asked(modal, lease)["timeout_secs"] == 1300
    renew = f"/v1/lease/{lease['lease_id']}/renew"
    assert sched.http.post(renew, json={"ttl_seconds": 1000}).status_code == 200
    past = sched.http.post(renew, json={"ttl_seconds": 1150})
    assert past.status_code == 409 and past.json()["error"] == "past_provider_deadline"
