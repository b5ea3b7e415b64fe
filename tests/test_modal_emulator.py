"""The Modal emulator, driven by the official `modal` client (in this process, pointed at
the emulator by MODAL_SERVER_URL and the token pair): what a Modal provider will see.

Each test gets a fresh emulator state (`reset`: every sandbox ended and its container
removed); the emulator process is one per module (`modal_server`, conftest.py), and
removes its containers at exit.
"""

from __future__ import annotations

import http.server
import json
import os
import ssl
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import modal
import modal.exception
import pytest

from tests.harness import TLS, WORKER_IMAGE, docker_client, wait_for
from tests.modal_emulator import CHECKED_CLIENT_VERSION, LABEL_INSTANCE, ModalEmulator
from tests.modal_emulator.make_contract import build, differences, load
from tests.oom import oom_kill_docker_hears

WORKER = ("/bin/sh", "/entry.sh")  # the demo worker's own start, given explicitly
LEASE_VALUE = "lease-" + uuid.uuid4().hex  # a value that must only reach the container


@pytest.fixture
def emulator(
    modal_server: ModalEmulator, monkeypatch: pytest.MonkeyPatch
) -> Iterator[ModalEmulator]:
    modal_server.reset()
    for key, value in modal_server.client_env().items():
        monkeypatch.setenv(key, value)
    yield modal_server
    modal_server.reset()


@pytest.fixture
def client(emulator: ModalEmulator) -> Iterator[modal.Client]:
    with modal.Client.from_credentials(emulator.token_id, emulator.token_secret) as c:
        yield c


@pytest.fixture
def app(client: modal.Client) -> modal.App:
    return modal.App.lookup("openalice-tests", create_if_missing=True, client=client)


@pytest.fixture
def image() -> modal.Image:
    return modal.Image.from_registry(WORKER_IMAGE)


@pytest.fixture(scope="module")
def emulator_ca(modal_server: ModalEmulator) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=modal_server.ca_file)


def worker_answer(url: str, context: ssl.SSLContext, timeout: float = 30) -> dict[str, Any]:
    """GET / of the demo worker behind a tunnel, once it answers."""

    def fetch() -> dict[str, Any] | None:
        try:
            response = httpx.get(url + "/", verify=context, timeout=5)
        except httpx.HTTPError:
            return None
        return dict(response.json()) if response.status_code == 200 else None

    return dict(wait_for(fetch, timeout, interval=0.2, what=f"the worker at {url}"))


def leased_worker(app: modal.App, image: modal.Image, kind: str, **options: Any) -> modal.Sandbox:
    """The demo worker in a sandbox as a provider starts one: `LEASE_VALUE` in a secret,
    `kind` in its env, its port 8080 behind a TLS tunnel."""
    return modal.Sandbox.create(
        *WORKER,
        app=app,
        image=image,
        secrets=[modal.Secret.from_dict({"LEASE_ID": LEASE_VALUE})],
        env={"WORKER_KIND": kind},
        encrypted_ports=[8080],
        **options,
    )


def container_gone(container_id: str) -> bool:
    return not docker_client().containers.list(all=True, filters={"id": container_id})


def rpcs(emulator: ModalEmulator) -> list[str]:
    return [call["rpc"] for call in emulator.calls()]  # every call answered, in order


# --- the protocol the emulator was checked against ---------------------------------------


def test_the_installed_client_is_the_one_the_emulator_was_checked_against() -> None:
    assert modal.__version__ == CHECKED_CLIENT_VERSION
    assert differences(load(), build()) == []


def test_a_client_of_another_version_is_refused(
    emulator: ModalEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODAL_OVERRIDE_HEADERS", "x-modal-client-version:1.7.0")
    with (
        modal.Client.from_credentials(emulator.token_id, emulator.token_secret) as newer,
        pytest.raises(modal.exception.ConflictError, match="checked against"),
    ):
        modal.App.lookup("openalice-tests", create_if_missing=True, client=newer)


# --- apps, auth, images ---------------------------------------------------------------------


def test_an_app_is_created_once_and_found_again(client: modal.Client) -> None:
    made = modal.App.lookup("apps-once", create_if_missing=True, client=client)
    found = modal.App.lookup("apps-once", client=client)
    assert made.app_id is not None and made.app_id.startswith("ap-")
    assert found.app_id == made.app_id
    assert modal.App.lookup(made.app_id, client=client).app_id == made.app_id
    with pytest.raises(modal.exception.NotFoundError):
        modal.App.lookup("never-made", client=client)


def test_a_wrong_token_is_refused(emulator: ModalEmulator) -> None:
    for token_id, token_secret in [
        ("ak-wrong", emulator.token_secret),
        (emulator.token_id, "as-wrong"),
    ]:
        with (
            modal.Client.from_credentials(token_id, token_secret) as wrong,
            pytest.raises(modal.exception.AuthError),
        ):
            modal.App.lookup("openalice-tests", create_if_missing=True, client=wrong)
    assert [c["status"] for c in emulator.calls("AppGetOrCreate")] == ["UNAUTHENTICATED"] * 2
    assert "openalice-tests" not in [a["name"] for a in emulator.state()["apps"]]


def test_an_image_missing_locally_fails_its_build(app: modal.App) -> None:
    missing = modal.Image.from_registry(f"openalice-no-such-image:{uuid.uuid4().hex[:8]}")
    with pytest.raises(modal.exception.ImageBuildError, match="never pulls"):
        modal.Sandbox.create(*WORKER, app=app, image=missing)


# --- sandboxes: both paths, env, tunnels ------------------------------------------------------


def test_a_gpu_sandbox_takes_the_older_path_and_its_worker_answers_over_https(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, emulator_ca: ssl.SSLContext
) -> None:
    sandbox = leased_worker(app, image, "renderer", gpu="L4", cpu=1.5, memory=768, timeout=900)
    tunnel = sandbox.tunnels()[8080]
    assert tunnel.url.startswith("https://127.0.0.1:")
    # The worker got its secret and env, and answers through the TLS tunnel.
    answer = worker_answer(tunnel.url, emulator_ca)
    assert answer["lease_id"] == LEASE_VALUE and answer["kind"] == "renderer"
    # A caller that trusts only the public CAs cannot talk to it.
    with pytest.raises(httpx.ConnectError):
        httpx.get(tunnel.url, verify=TLS, timeout=5)

    record = emulator.sandbox(sandbox.object_id)
    assert record["api"] == "v1" and record["state"] == "running"
    assert record["gpu"] == "L4" and record["gpu_count"] == 1
    assert (record["cpu"], record["memory_mb"], record["timeout_secs"]) == (1.5, 768, 900)
    assert record["image"] == WORKER_IMAGE and record["command"] == list(WORKER)
    assert record["ports"] == [{"port": 8080, "encrypted": True, "h2": False}]
    assert record["env_keys"] == ["LEASE_ID", "WORKER_KIND"]
    assert record["tunnels"][0]["connections"] >= 1
    assert LEASE_VALUE not in json.dumps(emulator.state())
    calls = rpcs(emulator)
    assert {"SecretGetOrCreate", "SandboxCreate", "SandboxGetTaskId"} <= set(calls)
    assert "SandboxCreateV2" not in calls

    # A real container of the image, on the emulator's network; the value is in its
    # config, not on its command line.
    container = docker_client().containers.get(record["container_id"])
    assert container.attrs["Config"]["Image"] == WORKER_IMAGE
    assert emulator.network in container.attrs["NetworkSettings"]["Networks"]
    assert container.labels[LABEL_INSTANCE] == emulator.instance
    command_line = [container.attrs["Path"], *container.attrs["Args"]]
    assert command_line == list(WORKER) and LEASE_VALUE not in " ".join(command_line)
    assert f"LEASE_ID={LEASE_VALUE}" in container.attrs["Config"]["Env"]


def test_a_sandbox_without_gpu_takes_the_v2_path(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, emulator_ca: ssl.SSLContext
) -> None:
    sandbox = leased_worker(app, image, "anim", timeout=600)
    answer = worker_answer(sandbox.tunnels()[8080].url, emulator_ca)
    assert answer["lease_id"] == LEASE_VALUE and answer["kind"] == "anim"
    record = emulator.sandbox(sandbox.object_id)
    assert (record["api"], record["gpu"], record["timeout_secs"]) == ("v2", None, 600)
    assert record["env_keys"] == ["LEASE_ID", "WORKER_KIND"]
    calls = rpcs(emulator)
    assert {"AuthTokenGet", "SandboxCreateV2"} <= set(calls)
    assert not {"SandboxCreate", "SecretGetOrCreate"} & set(calls)  # secrets went inline
    assert LEASE_VALUE not in json.dumps(emulator.state())


def test_an_unencrypted_port_is_served_as_plain_tcp_too(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, emulator_ca: ssl.SSLContext
) -> None:
    sandbox = modal.Sandbox.create(*WORKER, app=app, image=image, unencrypted_ports=[8080])
    tunnel = sandbox.tunnels()[8080]
    host, port = tunnel.tcp_socket
    assert worker_answer(f"http://{host}:{port}", emulator_ca)["worker"] == "openalice-demo"
    assert worker_answer(f"https://{tunnel.host}:{tunnel.port}", emulator_ca)
    # V2 create answers only encrypted tunnels: the client asked for the rest.
    assert "SandboxGetTunnelsV2" in rpcs(emulator)


def test_a_sandbox_without_a_command_runs_nothing_of_its_image(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, emulator_ca: ssl.SSLContext
) -> None:
    sandbox = modal.Sandbox.create(app=app, image=image, encrypted_ports=[8080])
    url = sandbox.tunnels()[8080].url
    with pytest.raises(httpx.HTTPError):  # no CMD ran: nothing listens
        httpx.get(url, verify=emulator_ca, timeout=5)
    assert sandbox.poll() is None  # it sleeps
    assert emulator.sandbox(sandbox.object_id)["command"] is None


def test_a_named_sandbox_is_found_by_name_and_its_name_is_taken(
    app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    sandbox = modal.Sandbox.create(app=app, image=image, name="worker-1")
    found = modal.Sandbox.from_name("openalice-tests", "worker-1", client=client)
    assert found.object_id == sandbox.object_id
    with pytest.raises(modal.exception.AlreadyExistsError):
        modal.Sandbox.create(app=app, image=image, name="worker-1")


def test_another_process_with_the_client_env_reaches_the_worker_through_its_tunnel(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, emulator_ca: ssl.SSLContext
) -> None:
    """What the scheduler does: the client from MODAL_* alone, the tunnel trusted through
    SSL_CERT_FILE by httpx's default context."""
    sandbox = modal.Sandbox.create(
        *WORKER, app=app, image=image, env={"LEASE_ID": LEASE_VALUE}, encrypted_ports=[8080]
    )
    worker_answer(sandbox.tunnels()[8080].url, emulator_ca)  # it listens by now
    script = textwrap.dedent("""
        import json, sys
        import httpx, modal
        sandbox = modal.Sandbox.from_id(sys.argv[1])
        url = sandbox.tunnels()[8080].url
        for attempt in range(3):  # a connection closed unanswered once: tried again
            try:
                print(json.dumps(httpx.get(url + "/", timeout=5).json()))
                break
            except httpx.TransportError:
                if attempt == 2:
                    raise
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    done = subprocess.run(
        [sys.executable, "-c", script, sandbox.object_id],
        env={**env, **emulator.client_env()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["lease_id"] == LEASE_VALUE
    assert "SandboxWaitV2" in rpcs(emulator)  # from_id of a V2 sandbox


def test_a_sandbox_reaches_a_server_on_the_host_at_the_network_gateway(
    emulator: ModalEmulator, app: modal.App, image: modal.Image
) -> None:
    """The worker's way to the scheduler (its self-check), as to a public URL on Modal."""
    gateway = emulator.network_gateway
    assert gateway is not None
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

    server = http.server.ThreadingHTTPServer((gateway, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://{gateway}:{server.server_address[1]}/v1/lease/l-1/self"
        probe = ("/bin/busybox", "timeout", "10", "/bin/busybox", "wget", "-q", "-O", "-", url)
        sandbox = modal.Sandbox.create(*probe, app=app, image=image)
        sandbox.wait()
        assert sandbox.returncode == 0
        assert asked == ["/v1/lease/l-1/self"]
    finally:
        server.shutdown()
        server.server_close()


# --- tags and listing --------------------------------------------------------------------------


def test_tags_filter_the_list_which_pages_until_an_empty_page(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    made = [
        modal.Sandbox.create(app=app, image=image, tags={"pool": "p1", "n": str(n)})
        for n in range(3)
    ]
    other = modal.Sandbox.create(app=app, image=image, tags={"pool": "p2"})
    made[0].set_tags({"pool": "p1", "n": "0", "warm": "yes"})
    assert made[0].get_tags() == {"pool": "p1", "n": "0", "warm": "yes"}

    emulator.set_list_page_size(1)
    listed = modal.Sandbox.list(app_id=app.app_id, tags={"pool": "p1"}, client=client)
    assert [s.object_id for s in listed] == [s.object_id for s in reversed(made)]
    assert len(emulator.calls("SandboxListV2")) == 4  # three pages of one, then an empty one

    def ids(tags: dict[str, str]) -> list[str]:
        found = modal.Sandbox.list(app_id=app.app_id, tags=tags, client=client)
        return [s.object_id for s in found]

    assert ids({"warm": "yes"}) == [made[0].object_id]
    assert ids({"pool": "p2"}) == [other.object_id]
    made[1].terminate()
    assert ids({"pool": "p1"}) == [made[2].object_id, made[0].object_id]  # running ones only


def test_listed_sandboxes_of_either_kind_can_be_terminated(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    """A provider's reconciliation: find its sandboxes by tag, end the ones it lost."""
    owned = {"owner": "scheduler-1"}
    made = [
        modal.Sandbox.create(*WORKER, app=app, image=image, gpu="L4", tags=owned),
        modal.Sandbox.create(*WORKER, app=app, image=image, tags=owned),
    ]
    listed = list(modal.Sandbox.list(app_id=app.app_id, tags=owned, client=client))
    assert {s.object_id for s in listed} == {s.object_id for s in made}
    for sandbox in listed:
        assert sandbox.returncode is None
        sandbox.terminate()
    assert list(modal.Sandbox.list(app_id=app.app_id, tags=owned, client=client)) == []
    assert [emulator.sandbox(s.object_id)["result"]["returncode"] for s in made] == [137, 137]
    terminated = {c["rpc"] for c in emulator.calls() if c["rpc"].startswith("SandboxTerminate")}
    assert terminated == {"SandboxTerminate", "SandboxTerminateV2"}  # each by its own kind


# --- the end of a sandbox ----------------------------------------------------------------------


def test_the_deadline_ends_a_sandbox_on_the_moved_clock(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    # Frozen, the clock moves by `advance_clock` alone: however long this test takes on a
    # loaded machine, 599 s is short of a 600 s timeout and 1 s more reaches it.
    emulator.freeze_clock()
    sandbox = modal.Sandbox.create(*WORKER, app=app, image=image, timeout=600)
    record = emulator.sandbox(sandbox.object_id)
    container_id = record["container_id"]
    assert record["started_at"] == emulator.state()["clock"]["now"]  # no real time passes
    assert emulator.advance_clock(599) == []
    assert sandbox.poll() is None
    assert emulator.advance_clock(1) == [sandbox.object_id]

    with pytest.raises(modal.exception.SandboxTimeoutError):
        sandbox.wait()
    assert sandbox.returncode == 124
    assert container_gone(container_id)
    assert modal.Sandbox.from_id(sandbox.object_id, client=client).returncode == 124
    assert modal.Sandbox.from_id(sandbox.object_id, client=client).poll() == 124
    sandbox.terminate()  # terminating an ended sandbox succeeds and changes nothing
    sandbox.poll()
    assert sandbox.returncode == 124
    assert emulator.sandbox(sandbox.object_id)["result"]["status"] == "TIMEOUT"


def test_a_frozen_clock_moves_only_when_moved_and_thaws_without_a_jump(
    emulator: ModalEmulator,
) -> None:
    emulator.freeze_clock()
    frozen = emulator.state()["clock"]
    assert frozen["frozen"] and emulator.state()["clock"]["now"] == frozen["now"]
    emulator.advance_clock(10)
    assert emulator.state()["clock"]["now"] == frozen["now"] + 10
    emulator.freeze_clock(False)
    thawed = emulator.state()["clock"]
    assert not thawed["frozen"] and frozen["now"] + 10 <= thawed["now"] < frozen["now"] + 40
    emulator.reset()
    assert not emulator.state()["clock"]["frozen"]


def test_the_deadline_also_passes_in_real_time(app: modal.App, image: modal.Image) -> None:
    sandbox = modal.Sandbox.create(app=app, image=image, timeout=2)
    started = time.monotonic()
    with pytest.raises(modal.exception.SandboxTimeoutError):
        sandbox.wait()
    assert time.monotonic() - started < 20
    assert sandbox.returncode == 124


def test_terminate_gives_137_and_is_idempotent(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    for gpu in ("T4", None):  # both generations
        sandbox = modal.Sandbox.create(*WORKER, app=app, image=image, gpu=gpu)
        container_id = emulator.sandbox(sandbox.object_id)["container_id"]
        assert sandbox.terminate(wait=True) == 137
        sandbox.terminate()
        sandbox.poll()
        assert sandbox.returncode == 137
        assert container_gone(container_id)
        again = modal.Sandbox.from_id(sandbox.object_id, client=client)
        assert again.returncode == 137 and again.poll() == 137
        again.terminate()
        with pytest.raises(modal.exception.SandboxTerminatedError):
            again.wait()
        assert emulator.sandbox(sandbox.object_id)["result"]["status"] == "TERMINATED"


def test_a_process_that_exits_ends_its_sandbox_with_its_code(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    for code, status in ((3, "FAILURE"), (0, "SUCCESS")):
        for gpu in ("T4", None):  # both generations
            command = ("/bin/sh", "-c", f"exit {code}")
            sandbox = modal.Sandbox.create(*command, app=app, image=image, gpu=gpu)
            sandbox.wait()  # an exit, even a failing one, is no error of wait()
            assert sandbox.returncode == code
            record = emulator.sandbox(sandbox.object_id)
            result = record["result"]
            assert (result["status"], result["returncode"]) == (status, code)
            assert record["container_id"]  # it ran, if only for a moment: in a container
            assert modal.Sandbox.from_id(sandbox.object_id, client=client).poll() == code


def test_an_oom_kill_ends_a_sandbox_as_modal_records_it(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    for gpu in ("T4", None):  # both generations
        sandbox = modal.Sandbox.create(
            *WORKER, app=app, image=image, gpu=gpu, memory=(256, 512), encrypted_ports=[8080]
        )
        record = emulator.sandbox(sandbox.object_id)
        assert record["memory_max_mb"] == 512
        result = emulator.oom_kill(sandbox.object_id)  # a real SIGKILL of its container
        assert (result["status"], result["returncode"]) == ("KERNEL_OOM_KILL", 137)
        assert "OOM" in result["exception"] and "512 MiB" in result["exception"]
        sandbox.wait()  # neither a timeout nor a termination: wait() returns
        assert sandbox.returncode == 137
        assert modal.Sandbox.from_id(sandbox.object_id, client=client).poll() == 137
        assert container_gone(record["container_id"])
        assert emulator.sandbox(sandbox.object_id)["result"] == result
        with pytest.raises(ValueError, match="running"):  # once only
            emulator.oom_kill(sandbox.object_id)


def test_only_a_running_sandbox_with_a_memory_limit_can_be_oom_killed(
    emulator: ModalEmulator, app: modal.App, image: modal.Image
) -> None:
    unlimited = modal.Sandbox.create(app=app, image=image, memory=512)  # a request only
    with pytest.raises(ValueError, match="no memory limit"):
        emulator.oom_kill(unlimited.object_id)
    assert unlimited.poll() is None
    emulator.set_max_sandboxes(1)
    queued = modal.Sandbox.create(app=app, image=image, memory=(256, 512))
    with pytest.raises(ValueError, match="pending"):
        emulator.oom_kill(queued.object_id)
    with pytest.raises(ValueError, match="404"):
        emulator.oom_kill("sb-nosuchsandbox")


def test_a_container_the_kernel_oom_killed_at_its_limit_is_reported_so(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    """A process really past the sandbox's hard memory limit: Docker says OOMKilled."""
    hog = ("/bin/busybox", "dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=1")

    def make() -> tuple[str, tuple[modal.Sandbox, dict[str, Any]]]:
        sandbox = modal.Sandbox.create(*hog, app=app, image=image, memory=(16, 32))
        sandbox.wait()
        assert sandbox.returncode == 137
        record = emulator.sandbox(sandbox.object_id)
        return record["container_id"], (sandbox, record["result"])

    def lost(outcome: tuple[modal.Sandbox, dict[str, Any]]) -> None:
        _, result = outcome  # Docker did not say OOMKilled (tests/oom.py): a plain kill
        assert (result["status"], result["returncode"]) == ("FAILURE", 137)

    sandbox, result = oom_kill_docker_hears(make, lost)
    assert (result["status"], result["returncode"]) == ("KERNEL_OOM_KILL", 137)
    assert "32 MiB" in result["exception"]
    assert modal.Sandbox.from_id(sandbox.object_id, client=client).poll() == 137


# --- capacity and failures ---------------------------------------------------------------------


def test_no_capacity_is_a_resource_exhausted_error(
    emulator: ModalEmulator, app: modal.App, image: modal.Image
) -> None:
    emulator.set_no_capacity(gpu="L4")
    with pytest.raises(modal.exception.ResourceExhaustedError):
        modal.Sandbox.create(*WORKER, app=app, image=image, gpu="L4")
    modal.Sandbox.create(*WORKER, app=app, image=image, gpu="H100")  # other types are fine
    emulator.set_no_capacity(gpu="*")
    with pytest.raises(modal.exception.ResourceExhaustedError):
        modal.Sandbox.create(*WORKER, app=app, image=image)
    refused = [c for c in emulator.calls() if c["status"] == "RESOURCE_EXHAUSTED"]
    assert [c["rpc"] for c in refused] == ["SandboxCreate", "SandboxCreateV2"]
    assert [s["gpu"] for s in emulator.sandboxes()] == ["H100"]  # refused ones left none


def create_in_background(**options: Any) -> tuple[threading.Thread, dict[str, Any]]:
    """`modal.Sandbox.create(*WORKER, **options)` in a thread of its own; the outcome's
    `sandbox` or `error` once it returned."""
    outcome: dict[str, Any] = {}

    def create() -> None:
        try:
            outcome["sandbox"] = modal.Sandbox.create(*WORKER, **options)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome["error"] = exc

    creating = threading.Thread(target=create, daemon=True)
    creating.start()
    return creating, outcome


def test_a_gpu_create_past_the_limit_waits_in_the_queue_until_a_place_frees(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    """V1 (a GPU): SandboxCreate answers at once, then the client polls SandboxGetTaskId
    every 0.5 s, answered no task id while its sandbox is queued: `create` returns once
    the sandbox is placed and runs, or raises if it is terminated meanwhile."""
    emulator.set_max_sandboxes(1)
    first = modal.Sandbox.create(*WORKER, app=app, image=image)
    creating, outcome = create_in_background(app=app, image=image, gpu="L4")

    def polled_while_queued(position: int) -> dict[str, Any] | None:
        queued = [s for s in emulator.sandboxes() if s["api"] == "v1"]
        if len(queued) <= position:
            return None
        sandbox_id = queued[position]["sandbox_id"]
        polls = [c for c in emulator.calls("SandboxGetTaskId") if c["sandbox_id"] == sandbox_id]
        return queued[position] if len(polls) >= 3 else None

    queued = wait_for(lambda: polled_while_queued(0), 60, what="polls for a task id")
    assert (queued["state"], queued["queued"]) == ("pending", True)
    assert (queued["task_id"], queued["container_id"], queued["started_at"]) == (None, None, None)
    assert creating.is_alive() and not outcome  # the create waits

    # Another one queued behind it, terminated while its create waits: that create fails.
    doomed, doomed_outcome = create_in_background(app=app, image=image, gpu="L4")
    behind = wait_for(lambda: polled_while_queued(1), 60, what="polls for a second task id")
    modal.Sandbox.from_id(behind["sandbox_id"], client=client).terminate()
    doomed.join(60)
    assert isinstance(doomed_outcome.get("error"), modal.exception.ConflictError)

    first.terminate()  # its place goes to the oldest queued sandbox
    creating.join(120)
    assert not creating.is_alive() and "error" not in outcome, outcome
    sandbox = outcome["sandbox"]
    assert sandbox.object_id == queued["sandbox_id"]
    record = emulator.sandbox(sandbox.object_id)
    assert (record["state"], record["queued"], record["gpu"]) == ("running", False, "L4")
    assert record["task_id"] and record["container_id"]
    assert sandbox.poll() is None
    assert emulator.sandbox(behind["sandbox_id"])["container_id"] is None  # never started


def test_a_queued_sandbox_is_created_at_once_and_its_tunnels_wait_for_its_start(
    emulator: ModalEmulator,
    app: modal.App,
    image: modal.Image,
    client: modal.Client,
    emulator_ca: ssl.SSLContext,
) -> None:
    """V2: SandboxCreateV2 answers a queued sandbox at once, with no task id and no
    tunnels; SandboxGetTunnelsV2 waits up to its timeout, then answers TIMEOUT
    (SandboxTimeoutError), and answers the tunnels once the sandbox runs."""
    emulator.set_max_sandboxes(1)
    first = modal.Sandbox.create(*WORKER, app=app, image=image)
    queued = modal.Sandbox.create(
        *WORKER, app=app, image=image, env={"LEASE_ID": LEASE_VALUE}, encrypted_ports=[8080]
    )
    record = emulator.sandbox(queued.object_id)
    assert (record["state"], record["queued"], record["task_id"]) == ("pending", True, None)
    assert record["container_id"] is None and record["tunnels"] == []
    assert queued.poll() is None  # not finished: a queued sandbox is listed, too
    listed = modal.Sandbox.list(app_id=app.app_id, client=client)
    assert [s.object_id for s in listed] == [queued.object_id, first.object_id]

    with pytest.raises(modal.exception.SandboxTimeoutError):
        queued.tunnels(timeout=1)
    asked = [c for c in emulator.calls("SandboxGetTunnelsV2") if c["status"] == "OK"]
    assert [c["sandbox_id"] for c in asked] == [queued.object_id]

    first.terminate()
    tunnel = queued.tunnels()[8080]  # waits for its start
    assert worker_answer(tunnel.url, emulator_ca)["lease_id"] == LEASE_VALUE
    assert emulator.sandbox(queued.object_id)["state"] == "running"


@pytest.mark.parametrize("gpu", [None, "L4"], ids=["v2", "v1"])
def test_a_running_sandbox_s_held_tunnels_time_out_until_reported(
    emulator: ModalEmulator,
    app: modal.App,
    image: modal.Image,
    emulator_ca: ssl.SSLContext,
    gpu: str | None,
) -> None:
    """`hold_tunnels`: a running sandbox whose tunnels Modal has not reported; the
    client's `tunnels(timeout)` raises SandboxTimeoutError after its timeout, as the
    client documents, and answers them once they are reported."""
    emulator.hold_tunnels()
    sandbox = leased_worker(app, image, "renderer", gpu=gpu)
    assert emulator.sandbox(sandbox.object_id)["state"] == "running"
    with pytest.raises(modal.exception.SandboxTimeoutError):
        sandbox.tunnels(timeout=1)
    emulator.hold_tunnels(False)
    tunnel = sandbox.tunnels(timeout=5)[8080]
    assert worker_answer(tunnel.url, emulator_ca)["lease_id"] == LEASE_VALUE


def test_a_private_registry_s_image_names_its_secret_and_an_unknown_one_is_not_found(
    emulator: ModalEmulator, app: modal.App, client: modal.Client
) -> None:
    name = f"registry-{uuid.uuid4().hex[:8]}"
    password = "pw-" + uuid.uuid4().hex
    modal.Secret.objects.create(
        name, {"REGISTRY_USERNAME": "robot", "REGISTRY_PASSWORD": password}, client=client
    )
    secret = modal.Secret.from_name(name, client=client)
    built = modal.Image.from_registry(WORKER_IMAGE, secret=secret).build(app)
    record = next(i for i in emulator.state()["images"] if i["image_id"] == built.object_id)
    assert record["registry_auth"] == "REGISTRY_AUTH_TYPE_STATIC_CREDS"
    assert record["registry_secret_id"] == secret.object_id and record["built_at"]
    assert password not in json.dumps(emulator.state())  # keys only, never values

    missing = modal.Secret.from_name(f"no-such-{uuid.uuid4().hex[:6]}", client=client)
    with pytest.raises(modal.exception.NotFoundError, match="not found"):
        modal.Image.from_registry(WORKER_IMAGE, secret=missing).build(app)


def test_queued_sandboxes_start_oldest_first_and_a_terminated_one_never_starts(
    emulator: ModalEmulator, app: modal.App, image: modal.Image, client: modal.Client
) -> None:
    emulator.set_max_sandboxes(1)
    running = modal.Sandbox.create(app=app, image=image)
    second, third, fourth = (modal.Sandbox.create(app=app, image=image) for _ in range(3))
    assert [s["queued"] for s in emulator.sandboxes()] == [False, True, True, True]

    third.terminate()  # while queued: it ends TERMINATED without ever starting
    assert third.poll() == 137
    with pytest.raises(modal.exception.SandboxTerminatedError):
        third.wait()
    assert modal.Sandbox.from_id(third.object_id, client=client).poll() == 137
    ended = emulator.sandbox(third.object_id)
    assert (ended["state"], ended["result"]["status"]) == ("ended", "TERMINATED")
    assert (ended["task_id"], ended["container_id"], ended["started_at"]) == (None, None, None)
    listed = [s.object_id for s in modal.Sandbox.list(app_id=app.app_id, client=client)]
    assert listed == [fourth.object_id, second.object_id, running.object_id]  # not the ended

    def state_of(sandbox: modal.Sandbox) -> str:
        return str(emulator.sandbox(sandbox.object_id)["state"])

    running.terminate()
    wait_for(lambda: state_of(second) == "running", 60, what="the oldest queued to start")
    assert state_of(fourth) == "pending" and state_of(third) == "ended"
    second.terminate()
    wait_for(lambda: state_of(fourth) == "running", 60, what="the next queued to start")
    assert emulator.sandbox(third.object_id)["container_id"] is None  # never started

    fifth = modal.Sandbox.create(app=app, image=image)
    assert state_of(fifth) == "pending"
    emulator.set_max_sandboxes(2)  # a raised limit places it at once
    wait_for(lambda: state_of(fifth) == "running", 60, what="a place from the raised limit")


def test_a_scheduling_delay_is_waited_out_by_create(
    emulator: ModalEmulator, app: modal.App, image: modal.Image
) -> None:
    emulator.set_schedule_delay(1.5)
    started = time.monotonic()
    sandbox = modal.Sandbox.create(*WORKER, app=app, image=image, gpu="L4")
    assert time.monotonic() - started >= 1.5
    assert emulator.sandbox(sandbox.object_id)["state"] == "running"
    assert len(emulator.calls("SandboxGetTaskId")) >= 2  # polled until scheduled


def test_failures_the_client_retries_and_a_terminate_that_fails_once(
    emulator: ModalEmulator, app: modal.App, image: modal.Image
) -> None:
    emulator.fail_next("SandboxGetTunnels*", calls=2, per_attempt=True)
    sandbox = modal.Sandbox.create(*WORKER, app=app, image=image, unencrypted_ports=[8080])
    assert 8080 in sandbox.tunnels()  # the client's retries got through
    statuses = [c["status"] for c in emulator.calls("SandboxGetTunnelsV2")]
    assert statuses == ["UNAVAILABLE", "UNAVAILABLE", "OK"]

    emulator.fail_terminate_once()
    with pytest.raises(modal.exception.ServiceError):
        sandbox.terminate()
    assert sandbox.poll() is None  # still running
    sandbox.terminate()
    sandbox.wait(raise_on_termination=False)
    assert sandbox.returncode == 137
    failed = [c for c in emulator.calls("SandboxTerminateV2") if c["status"] == "UNAVAILABLE"]
    assert len(failed) == 4 and len({c["idempotency_key"] for c in failed}) == 1  # 1 + 3 retries


# --- the emulator's own cleanup ------------------------------------------------------------------


def test_the_emulator_removes_its_containers_and_network_even_when_killed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    network = f"oa-modal-{uuid.uuid4().hex[:8]}"
    second = ModalEmulator(network=network, log_path=tmp_path / "emulator.log")
    label = {"label": f"{LABEL_INSTANCE}={second.instance}"}
    with second:
        monkeypatch.setenv("MODAL_SERVER_URL", second.server_url)
        with modal.Client.from_credentials(second.token_id, second.token_secret) as client:
            app = modal.App.lookup("cleanup", create_if_missing=True, client=client)
            image = modal.Image.from_registry(WORKER_IMAGE)
            for _ in range(2):
                modal.Sandbox.create(app=app, image=image)
        assert len(docker_client().containers.list(filters=label)) == 2
        assert docker_client().networks.list(names=[network])
        assert second.proc is not None
        second.proc.kill()  # no shutdown code of its own runs
        second.proc.wait(10)
    assert docker_client().containers.list(all=True, filters=label) == []
    assert docker_client().networks.list(names=[network]) == []
