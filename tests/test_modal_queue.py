"""Modal as its real service behaves (issue 35): a sandbox it cannot place yet is queued,
not refused, and given up after MODAL_START_TIMEOUT_SECONDS; the wait for its tunnel is
bounded by the provision timeout; images are resolved before any acquire; a private
registry's credentials come from a named Modal secret (MODAL_REGISTRY_SECRET). Against
the Modal emulator (tests/modal_emulator/), with the scheduler as a process."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import docker
import httpx
import pytest

from tests.harness import SHARED_ENGINE, WORKER_IMAGE, Scheduler, wait_for
from tests.modal_emulator import ModalEmulator
from tests.test_modal_provider import asked, on_modal, page_of

Make = Callable[..., Scheduler]
REGISTRY_PASSWORD = "rp-" + uuid.uuid4().hex  # a registry's password: in no log


@pytest.fixture
def modal(modal_server: ModalEmulator) -> ModalEmulator:
    modal_server.reset()
    return modal_server


@pytest.fixture
def fresh_image() -> Iterator[str]:
    """The demo worker under a tag of its own: an image Modal (the emulator) never built,
    so that its build is seen whenever it happens."""
    client = docker.DockerClient(base_url=SHARED_ENGINE)
    tag = f"openalice-demo-worker:modal-{uuid.uuid4().hex[:10]}"
    repository, _, name = tag.partition(":")
    client.images.get(WORKER_IMAGE).tag(repository, name)
    try:
        yield tag
    finally:
        client.images.remove(tag, noprune=True)
        client.close()


def in_background(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[Any]]:
    """`call` on a thread of its own; its answer (or exception) lands in the list."""
    answers: list[Any] = []

    def run() -> None:
        try:
            answers.append(call())
        except Exception as exc:  # noqa: BLE001 - the test reads it
            answers.append(exc)

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    return caller, answers


def queued(emulator: ModalEmulator) -> list[dict[str, Any]]:
    return [s for s in emulator.sandboxes() if s["queued"]]


def nothing_left(sched: Scheduler, emulator: ModalEmulator) -> None:
    """No sandbox running or queued, and no lease still `provisioning`."""
    wait_for(
        lambda: all(s["state"] == "ended" for s in emulator.sandboxes()),
        30,
        what="every sandbox to be ended",
    )
    assert all(s["result"]["status"] == "TERMINATED" for s in emulator.sandboxes())
    stuck = sched.http.get("/v1/leases", params={"state": ["provisioning"]}).json()
    assert stuck == []


# --- the queue and the start timeout -------------------------------------------------------


def test_a_sandbox_queued_by_modal_becomes_a_lease_once_capacity_comes(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, MODAL_GPU_TYPES="entry=L4")
    modal.set_max_sandboxes(0)  # Modal has no room: a create is queued, not refused
    caller, answers = in_background(
        lambda: sched.acquire(kind="renderer", gpu="entry", ttl_seconds=300)
    )
    waiting = wait_for(lambda: queued(modal), 30, what="Modal to queue the sandbox")
    assert waiting[0]["gpu"] == "L4" and waiting[0]["task_id"] in (None, "")
    assert answers == []  # the caller still waits

    modal.set_max_sandboxes(1)  # capacity comes: the queued sandbox starts
    caller.join(60)
    answer = answers[0]
    assert answer.status_code == 200, answer.text
    lease = answer.json()["lease"]
    # The lease is the sandbox that waited in the queue, and its worker answers.
    assert lease["provider_token"] == waiting[0]["sandbox_id"]
    assert asked(modal, lease)["state"] == "running"
    assert page_of(lease, modal)["lease_id"] == lease["lease_id"]
    assert len(modal.sandboxes()) == 1


def test_a_sandbox_queued_behind_another_starts_when_that_one_ends(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(make_scheduler, modal, MODAL_GPU_TYPES="entry=L4")
    modal.set_max_sandboxes(1)
    first = sched.lease(kind="renderer", gpu="entry", ttl_seconds=300)
    caller, answers = in_background(
        lambda: sched.acquire(kind="renderer", gpu="entry", ttl_seconds=300)
    )
    wait_for(lambda: queued(modal), 30, what="Modal to queue the second sandbox")
    assert sched.release(first["lease_id"]).status_code == 204
    caller.join(60)
    assert answers and answers[0].status_code == 200, answers
    second = answers[0].json()["lease"]
    assert second["provider_token"] != first["provider_token"]
    assert asked(modal, second)["state"] == "running"


def test_a_sandbox_still_queued_after_the_start_timeout_is_given_up(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(
        make_scheduler, modal, MODAL_GPU_TYPES="entry=L4", MODAL_START_TIMEOUT_SECONDS="2"
    )
    modal.set_max_sandboxes(0)
    refused = sched.acquire(kind="renderer", gpu="entry", ttl_seconds=300)
    # Alone, Modal's wait is a 503 reason naming it.
    assert refused.status_code == 503, refused.text
    reason = refused.json()["reasons"]["modal"]
    assert "MODAL_START_TIMEOUT_SECONDS" in reason and "queued" in reason, reason
    assert "L4" in reason
    # The queued sandbox was terminated: it never starts later, for no one.
    nothing_left(sched, modal)
    modal.set_max_sandboxes(None)
    assert all(s["started_at"] is None for s in modal.sandboxes())


def test_a_cpu_sandbox_still_queued_is_given_up_for_the_next_provider(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    sched = on_modal(
        make_scheduler,
        modal,
        PROVIDERS="modal,local-docker",
        MODAL_START_TIMEOUT_SECONDS="2",
    )
    modal.set_max_sandboxes(0)
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert lease["provider"] == "local-docker"
    # Given up at the start timeout (not at the end of a 50 s tunnel poll), terminated.
    gave_up = next(line for line in sched.log().splitlines() if "failed to provision" in line)
    assert "MODAL_START_TIMEOUT_SECONDS" in gave_up and "still queued" in gave_up, gave_up
    nothing_left(sched, modal)
    assert len(modal.sandboxes()) == 1  # asked once, then terminated


# --- the tunnel's bound ----------------------------------------------------------------


def test_a_tunnel_that_never_comes_ends_the_acquire_within_the_provision_timeout(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    # 20 s: the wait ends 5 s before it, time enough to terminate on a loaded machine.
    sched = on_modal(make_scheduler, modal, PROVISION_TIMEOUT_SECONDS="20")
    modal.hold_tunnels()  # the sandbox runs; Modal never reports its tunnel
    answer = sched.acquire(kind="renderer", ttl_seconds=300)
    assert answer.status_code in (502, 503), answer.text
    body = answer.json()
    said = {**body.get("reasons", {}), **body.get("failures", {})}["modal"]
    # The provider's own reason, given before the service's "no worker after 20 s".
    assert "tunnel" in said and "within 15 s (PROVISION_TIMEOUT_SECONDS (20 s)" in said, said
    assert "no worker after" not in said
    nothing_left(sched, modal)


# --- images -----------------------------------------------------------------------------


def test_the_first_acquire_does_not_pay_for_the_image_s_build(
    make_scheduler: Make, modal: ModalEmulator, fresh_image: str
) -> None:
    sched = on_modal(make_scheduler, modal, MODAL_RENDERER_IMAGE=fresh_image)
    built = wait_for(
        lambda: next(
            (i for i in modal.state()["images"] if i["reference"] == fresh_image and i["built_at"]),
            None,
        ),
        60,
        what="the image to be built at start-up",
    )
    before = len(modal.calls())
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert asked(modal, lease)["image"] == fresh_image
    acquire_calls = modal.calls()[before:]
    creates = [c for c in acquire_calls if c["rpc"].startswith("SandboxCreate")]
    assert creates and all(c["at"] > built["built_at"] for c in creates)
    # Nothing about the image in the acquire's path: no build, not even a lookup.
    assert [c["rpc"] for c in acquire_calls if c["rpc"].startswith("Image")] == []
    assert f"image {fresh_image} resolved" in sched.log()


def test_an_acquire_during_the_start_up_build_waits_for_it_and_builds_nothing_itself(
    make_scheduler: Make, modal: ModalEmulator, fresh_image: str
) -> None:
    modal.set_rpc_delay("ImageJoinStreaming", 4)  # a build that takes a while
    sched = on_modal(
        make_scheduler, modal, MODAL_RENDERER_IMAGE=fresh_image, MODAL_ANIM_IMAGE=fresh_image
    )
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    assert asked(modal, lease)["image"] == fresh_image
    # One build, the one started at start-up: the acquire waited for it, and its create
    # only named the image Modal had then.
    assert [c["rpc"] for c in modal.calls() if c["rpc"].startswith("Image")] == [
        "ImageGetOrCreate",
        "ImageJoinStreaming",
    ]


def test_an_image_that_cannot_be_resolved_is_told_at_start_and_in_the_503(
    make_scheduler: Make, modal: ModalEmulator, fresh_image: str
) -> None:
    missing = fresh_image.replace("openalice-demo-worker", "openalice-not-yet")
    sched = on_modal(make_scheduler, modal, MODAL_RENDERER_IMAGE=missing)
    wait_for(lambda: missing in sched.log(), 60, what="the start-up warning")
    warning = next(line for line in sched.log().splitlines() if missing in line)
    assert "could not be resolved" in warning and "ImageBuildError" in warning, warning
    refused = sched.acquire(kind="renderer", ttl_seconds=300)
    assert refused.status_code == 503, refused.text
    reason = refused.json()["reasons"]["modal"]
    assert missing in reason and "not on the local Docker engine" in reason, reason
    assert modal.sandboxes() == []  # nothing was created for it

    # The image appears: a later attempt, made in the background, resolves it, with no
    # restart, and acquires are served again.
    client = docker.DockerClient(base_url=SHARED_ENGINE)
    repository, _, tag = missing.partition(":")
    client.images.get(fresh_image).tag(repository, tag)
    try:
        served = wait_for(
            lambda: (
                (answer := sched.acquire(kind="renderer", ttl_seconds=300)).status_code == 200
                and answer.json()["lease"]
            ),
            90,
            interval=1,
            what="the image to be resolved again",
        )
        assert asked(modal, served)["image"] == missing
    finally:
        client.images.remove(missing, noprune=True)
        client.close()


# --- a private registry -----------------------------------------------------------------


def registry_secret(emulator: ModalEmulator, monkeypatch: pytest.MonkeyPatch) -> str:
    """A named Modal secret with a registry's username and password, made as its owner
    would, with the official client."""
    for key, value in emulator.client_env().items():
        monkeypatch.setenv(key, value)
    import modal as modal_client

    name = f"registry-{uuid.uuid4().hex[:8]}"
    with modal_client.Client.from_credentials(emulator.token_id, emulator.token_secret) as client:
        modal_client.Secret.objects.create(
            name,
            {"REGISTRY_USERNAME": "robot", "REGISTRY_PASSWORD": REGISTRY_PASSWORD},
            client=client,
        )
    return name


def test_a_private_registry_s_credentials_come_from_a_named_modal_secret(
    make_scheduler: Make,
    modal: ModalEmulator,
    fresh_image: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = registry_secret(modal, monkeypatch)
    sched = on_modal(
        make_scheduler, modal, MODAL_RENDERER_IMAGE=fresh_image, MODAL_REGISTRY_SECRET=name
    )
    lease = sched.lease(kind="renderer", ttl_seconds=300)
    image_id = asked(modal, lease)["image_id"]
    image = next(i for i in modal.state()["images"] if i["image_id"] == image_id)
    # The image was pulled with the secret's credentials, a username and a password.
    assert image["registry_auth"] == "REGISTRY_AUTH_TYPE_STATIC_CREDS"
    secret_ids = [s["secret_id"] for s in modal.state()["secrets"]]
    assert image["registry_secret_id"] in secret_ids
    # The password stays in Modal: the scheduler never had it.
    assert REGISTRY_PASSWORD not in sched.log()
    assert REGISTRY_PASSWORD not in sched.http.get("/v1/providers").text


def test_a_registry_secret_modal_does_not_have_is_named_in_the_503(
    make_scheduler: Make, modal: ModalEmulator
) -> None:
    name = f"no-such-secret-{uuid.uuid4().hex[:6]}"
    sched = on_modal(make_scheduler, modal, MODAL_REGISTRY_SECRET=name)
    wait_for(lambda: "could not be resolved" in sched.log(), 60, what="the start-up warning")
    refused = sched.acquire(kind="renderer", ttl_seconds=300)
    assert refused.status_code == 503, refused.text
    reason = refused.json()["reasons"]["modal"]
    assert "NotFoundError" in reason and name in reason, reason
    assert "MODAL_REGISTRY_SECRET" in reason
    assert modal.sandboxes() == []
