"""Readiness and drain, with real signals sent to a real scheduler process.

- SIGTERM: callers waiting in line for capacity are answered 503 `shutting_down` (with
  `Retry-After`) at once, and the process exits 0;
- a provision under way (real Docker, its container start held a few seconds by the
  fault proxy) finishes and is answered 200; its lease is `active` in the store, none is
  left `provisioning`; meanwhile `/readyz` says 503 and new acquires get 503;
- a provision longer than SHUTDOWN_GRACE_SECONDS (a RunPod pod that is slow to run) is
  answered 503 when the grace is over, the process exits, and the restarted service
  resolves the lease by reconciliation (pod destroyed, lease failed);
- a second signal does not wait for the grace;
- `/readyz` is 200 when ready and names an unreachable store (PostgreSQL stopped for
  real) without a word of its address; in-process, on a real SQLite store, it waits for
  a finished reconciliation when the one before serving could not finish."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import sqlite3
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.trace import NoOpTracer

from openalice_scheduler.errors import ShuttingDown
from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.lifecycle.policy import OrderedFirstAvailable
from openalice_scheduler.lifecycle.states import STATE_SETS
from openalice_scheduler.loops import Reconciler
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.models import LeaseRequest, WorkerKind
from openalice_scheduler.readiness import ReadinessCheck
from openalice_scheduler.store import open_store
from tests.dockerproxy import DockerProxy
from tests.harness import HTTP, SECRET, TLS, Scheduler, wait_for
from tests.postgres import PrivatePostgres
from tests.runpod_emulator import RunPodEmulator

KEY = "rpk-drain-" + uuid.uuid4().hex
START = r"^POST /v[\d.]+/containers/[^/?]+/start(\?|$)"
STATIC = {"PROVIDERS": "static", "STATIC_WORKERS": "renderer=http://w1:1"}
Make = Callable[..., Scheduler]


# --- helpers ---------------------------------------------------------------------------


class Call:
    """One HTTP call made from a thread of its own, on a connection of its own; `done_at`
    is when its answer (or error) came back."""

    def __init__(self, s: Scheduler, method: str, path: str, **kwargs: Any) -> None:
        self.response: httpx.Response | None = None
        self.error: httpx.HTTPError | None = None
        self.done_at = 0.0
        self._thread = threading.Thread(
            target=self._run, args=(s, method, path, kwargs), daemon=True
        )
        self._thread.start()

    def _run(self, s: Scheduler, method: str, path: str, kwargs: dict[str, Any]) -> None:
        try:
            with httpx.Client(
                verify=TLS, base_url=s.url, headers={"X-Internal-Secret": SECRET}, timeout=180
            ) as client:
                self.response = client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self.error = exc
        self.done_at = time.monotonic()

    def result(self, timeout: float = 60) -> httpx.Response:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "no answer in time"
        assert self.response is not None, f"no answer: {self.error!r}"
        return self.response


def acquire(s: Scheduler, **body: Any) -> Call:
    return Call(s, "POST", "/v1/lease", json={"kind": "renderer", **body})


def stored_states(s: Scheduler) -> dict[str, str]:
    """lease_id → state, as recorded in the scheduler's SQLite file (read-only)."""
    path = s.env["DATABASE_URL"].removeprefix("sqlite:///")
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)) as db:
        return dict(db.execute("SELECT lease_id, state FROM leases").fetchall())


def readyz(s: Scheduler) -> httpx.Response:
    return HTTP.get(f"{s.url}/readyz", timeout=30)


def exit_code(s: Scheduler, timeout: float) -> int:
    assert s.proc is not None
    return s.proc.wait(timeout)


def assert_shutting_down(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"] == "shutting_down", response.text
    assert int(response.headers["Retry-After"]) >= 1
    # The retry goes out on a new connection, which a balancer can send elsewhere.
    assert response.headers["Connection"] == "close"


def assert_clean_log(s: Scheduler) -> None:
    """No traceback, no uvicorn 500 for a cancelled request."""
    log = s.log()
    assert "Traceback" not in log, log[-3000:]
    assert "Exception in ASGI application" not in log, log[-3000:]


@pytest.fixture
def proxy() -> Iterator[DockerProxy]:
    """A fault-injecting proxy in front of the shared Docker engine."""
    where = Path(tempfile.mkdtemp(prefix="oa-proxy-", dir="/tmp"))  # short socket path
    p = DockerProxy(where / "docker.sock", "/var/run/docker.sock").start()
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def runpod(runpod_server: RunPodEmulator) -> RunPodEmulator:
    runpod_server.reset()
    return runpod_server


def on_runpod(runpod: RunPodEmulator, **env: str) -> dict[str, str]:
    return {
        "PROVIDERS": "runpod",
        "RUNPOD_API_KEY": KEY,
        "RUNPOD_API_BASE_URL": runpod.base_url,
        "RUNPOD_POLL_INTERVAL_SECONDS": "0.1",
        "RUNPOD_CATALOG_TTL_SECONDS": "0",
        **env,
    }


# --- waiting callers ---------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_sigterm_answers_callers_waiting_in_line_at_once(make_scheduler: Make) -> None:
    s = make_scheduler(**STATIC)
    held = s.lease(kind="renderer")  # the only endpoint: the next callers wait
    waiting = [acquire(s, wait_seconds=120, correlation_id=f"w{i}") for i in range(3)]
    wait_for(lambda: s.log().count("waits up to") >= 3, 30, what="three callers in line")

    assert s.proc is not None
    signalled = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)

    for call in waiting:
        assert_shutting_down(call.result())
        # At once, not when its 120 s wait ends (5 s: room for a loaded machine).
        assert call.done_at - signalled < 5.0, "a waiting caller was not answered at once"
    assert exit_code(s, 30) == 0
    assert_clean_log(s)
    # The lease held before the signal is kept as it was; nothing is left half-made.
    assert stored_states(s) == {held["lease_id"]: "active"}
    s.start()
    assert s.leases() == [held]


# --- a provision under way -------------------------------------------------------------


@pytest.mark.timeout(240)
def test_sigterm_lets_a_provision_under_way_finish_and_be_answered(
    proxy: DockerProxy, make_scheduler: Make
) -> None:
    s = make_scheduler(DOCKER_HOST=proxy.url)
    ready = readyz(s)
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"ready": True}

    proxy.delay(START, 4)  # the container's start reaches Docker 4 s late
    call = acquire(s, correlation_id="under-way")
    proxy.wait_held(1, timeout=60)
    assert s.proc is not None
    s.proc.send_signal(signal.SIGTERM)

    # While it drains: not ready, no new acquire, still alive.
    draining = wait_for(
        lambda: (r := readyz(s)).status_code == 503 and r, 10, what="/readyz to say 503"
    )
    body = draining.json()
    assert body["ready"] is False and body["reasons"] == ["shutting down"], body
    assert body["error"] == "shutting_down"
    assert_shutting_down(acquire(s).result())
    assert HTTP.get(f"{s.url}/health", timeout=30).status_code == 200

    answer = call.result()
    assert answer.status_code == 200, answer.text
    lease = answer.json()["lease"]
    assert lease["state"] == "active"
    assert exit_code(s, 30) == 0
    assert_clean_log(s)
    assert stored_states(s) == {lease["lease_id"]: "active"}  # none left provisioning
    [container] = s.containers()
    assert container.status == "running"

    proxy.clear()
    s.start()
    found = s.http.get(f"/v1/lease/{lease['lease_id']}")
    assert found.status_code == 200 and found.json()["state"] == "active", found.text
    assert s.release(lease["lease_id"]).status_code == 204
    assert s.containers() == []


@pytest.mark.timeout(240)
def test_a_provision_longer_than_the_grace_is_answered_and_reconciled_after_restart(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    runpod.provision_delay = 300  # the pod would run only after 5 min
    s = make_scheduler(**on_runpod(runpod, SHUTDOWN_GRACE_SECONDS="2"))
    call = acquire(s, gpu="mid")
    wait_for(lambda: runpod.call_count("create") == 1, 30, what="the pod to be created")
    wait_for(lambda: list(stored_states(s).values()) == ["provisioning"], 30)

    assert s.proc is not None
    signalled = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert exit_code(s, 60) == 0
    assert time.monotonic() - signalled >= 2, "the process did not give the grace"

    # The caller is told, not cut off: a 503 it can retry elsewhere.
    assert_shutting_down(call.result())
    assert_clean_log(s)
    # Left as after a crash: the lease provisioning, its pod there.
    [lease_id] = stored_states(s)
    assert stored_states(s) == {lease_id: "provisioning"}
    assert len(runpod.list_pods()) == 1

    s.start()  # start-up reconciliation runs before the service answers
    assert runpod.list_pods() == []
    assert stored_states(s) == {lease_id: "failed"}
    assert s.leases() == []
    assert KEY not in s.log()


@pytest.mark.timeout(240)
def test_a_second_signal_ends_the_drain_at_once(
    make_scheduler: Make, runpod: RunPodEmulator
) -> None:
    runpod.provision_delay = 300
    s = make_scheduler(**on_runpod(runpod, SHUTDOWN_GRACE_SECONDS="600"))
    call = acquire(s, gpu="mid")
    wait_for(lambda: runpod.call_count("create") == 1, 30, what="the pod to be created")

    assert s.proc is not None
    s.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: readyz(s).status_code == 503, 10, what="the drain to begin")
    s.proc.send_signal(signal.SIGINT)
    # Far sooner than the 600 s grace.
    assert exit_code(s, 30) == 0
    assert_shutting_down(call.result())
    assert_clean_log(s)

    s.start()
    assert runpod.list_pods() == []
    assert list(stored_states(s).values()) == ["failed"]


# --- readiness ---------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_readyz_names_an_unreachable_store_and_recovers(
    private_pg: PrivatePostgres, make_scheduler: Make
) -> None:
    s = make_scheduler(DATABASE_URL=private_pg.url, **STATIC)
    ready = readyz(s)
    assert (ready.status_code, ready.json()) == (200, {"ready": True})

    private_pg.stop()
    try:
        down = readyz(s)
        assert down.status_code == 503, down.text
        body = down.json()
        assert body["ready"] is False and body["reasons"] == ["store unavailable"], body
        assert body["error"] == "not_ready"
        # Nothing of the database's address: no URL, no socket path, no user.
        for secretish in (private_pg.url, str(private_pg.root), "postgresql", "host="):
            assert secretish not in down.text
        # Liveness is another question: the balancer must not kill the process.
        assert HTTP.get(f"{s.url}/health", timeout=30).status_code == 200
    finally:
        private_pg.start()
    wait_for(
        lambda: readyz(s).status_code == 200,
        60,
        interval=0.2,
        what="ready again once the store is back",
    )
    assert s.lease(kind="renderer")["state"] == "active"


class TellingReconciler(Reconciler):
    """The reconciler, telling when its first pass has finished (`finished`). The loop
    counts the pass (what readiness reads) in the same step of the event loop as the
    pass returns, before anyone waiting on `finished` runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finished = asyncio.Event()

    async def run_once(self) -> dict[str, int]:
        totals = await super().run_once()
        self.finished.set()
        return totals


async def test_ready_once_a_reconciliation_finished_and_not_while_draining(
    tmp_path: Path,
) -> None:
    store = open_store(f"sqlite:///{tmp_path / 'ready.db'}", states=STATE_SETS)
    await store.migrate()
    service = LeaseService(store, [], OrderedFirstAvailable(), Metrics(), NoOpTracer())
    reconciler = TellingReconciler(service, NoOpTracer(), 60, replica_timeout=30)
    try:
        # The pass before serving did not finish: not ready until the loop's pass does.
        readiness = ReadinessCheck(service, reconciler, reconciled=False)
        assert await readiness.reasons() == ["start-up reconciliation not finished"]
        reconciler.start()
        await asyncio.wait_for(reconciler.finished.wait(), 30)
        assert await readiness.reasons() == []

        service.drain()
        assert await readiness.reasons() == ["shutting down"]
        with pytest.raises(ShuttingDown) as refused:
            await service.acquire(LeaseRequest(kind=WorkerKind.renderer))
        assert refused.value.status == 503 and refused.value.retry_after == 1
    finally:
        await reconciler.stop()
        await store.close()
