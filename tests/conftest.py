"""Fixtures: a real Docker engine, the demo worker image, an engine that accepts GPU
device requests, schedulers as processes, a migrated store on each database, the RunPod, Modal and
Kubernetes emulators, and the service's logging set up in the test process."""

from __future__ import annotations

import logging
import subprocess
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from openalice_scheduler.lifecycle.states import STATE_SETS
from openalice_scheduler.store import open_store
from tests.engines import PrivateEngine
from tests.harness import (
    REPO,
    WORKER_IMAGE,
    Scheduler,
    clean_up_all,
    database_url,
    docker_client,
    sweep_instances,
)
from tests.k8s_emulator import KubeEmulator
from tests.modal_emulator import ModalEmulator
from tests.postgres import PrivatePostgres
from tests.runpod_emulator import RunPodEmulator

# pytest-xdist hands out whole test files (--dist loadfile) in collection order, each
# worker taking the next as it runs short. The longest go first (the usual greedy rule for
# parallel work to end together), by each file's seconds in a run of 2026-12-07 (six
# workers); after them the files of under ~10 s, in the alphabet's order. So the run ends
# on short files, not on one worker finishing a long one alone: a file of ~30 s left in
# the alphabet's part was the last ~15-20 s of a run, the other five workers done. A new
# file of more than ~10 s belongs in this table. The service image's test comes first of
# all: from nothing, its build takes its worker a few minutes, during which the others run
# everything else.
FIRST = "test_image.py"
SECONDS = {
    "test_replicas.py": 154,
    "test_admission.py": 113,
    "test_fleet.py": 98,
    "test_runpod_e2e.py": 97,
    "test_warm_pool.py": 95,
    "test_lease_features.py": 71,
    "test_guard.py": 66,
    "test_runpod_provider.py": 64,
    "test_priorities.py": 60,
    "test_openapi.py": 57,
    "test_pool_demand.py": 55,
    "test_k8s_provider.py": 53,
    "test_admission_replicas.py": 52,
    "test_ui.py": 50,
    "test_modal_emulator.py": 48,
    "test_modal_queue.py": 48,
    "test_modal_provider.py": 45,
    "test_lifecycle.py": 42,
    "test_k8s_runtime.py": 42,
    "test_fence.py": 41,
    "test_k8s_loss.py": 41,
    "test_http.py": 41,
    "test_worker_loss.py": 35,
    "test_ready.py": 34,
    "test_client.py": 34,
    "test_runpod_client.py": 32,
    "test_worker_self.py": 31,
    "test_modal_loss.py": 31,
    "test_faults.py": 30,
    "test_enginewatch.py": 30,
    "test_k8s_clusters.py": 29,
    "test_lease_events.py": 28,
    "test_k8s_emulator.py": 26,
    "test_money.py": 26,
    "test_docker_provider.py": 25,
    "test_cli.py": 25,
    "test_runpod_loss.py": 24,
    "test_api.py": 24,
    "test_metrics.py": 22,
    "test_core.py": 19,
    "test_drain.py": 18,
    "test_store.py": 17,
    "test_logging.py": 16,
    "test_k8s_kubeconfig.py": 14,
    "test_usage.py": 13,
    "test_packaging.py": 13,
    "test_observability.py": 11,
    "test_runpod_emulator.py": 11,
}

# A file renamed or removed would leave its line here to order nothing: say so at once.
_GONE = sorted({FIRST, *SECONDS} - {path.name for path in Path(__file__).parent.glob("test_*.py")})
if _GONE:
    raise pytest.UsageError(f"tests/conftest.py orders test files that do not exist: {_GONE}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> tuple[int, float, str]:
        name = item.path.name
        return (name != FIRST, -SECONDS.get(name, 0), name)

    items.sort(key=rank)  # stable: within a module, the file's own order


@pytest.fixture(scope="session", autouse=True)
def docker_engine() -> Iterator[None]:
    try:
        docker_client().ping()
    except Exception as exc:  # noqa: BLE001 - any failure means no engine
        pytest.fail(
            f"no Docker engine answers on /var/run/docker.sock ({exc}); run the tests with "
            "scripts/test, which starts one",
            pytrace=False,
        )
    subprocess.run([str(REPO / "scripts" / "build-worker-image.sh"), WORKER_IMAGE], check=True)
    yield
    sweep_instances()


@pytest.fixture(scope="session")
def gpu_engine(docker_engine: None) -> Iterator[PrivateEngine]:
    """A Docker engine of the tests' own, with a no-op GPU hook on its PATH, for the
    tests whose workers get GPU device requests (`make_scheduler(engine=gpu_engine.url)`).
    The shared engine may have been started without one (by scripts/serve-demo, say)
    and is left as it is. Started once, by the first test that asks for it."""
    with PrivateEngine(gpu_shim=True) as engine:
        yield engine


@pytest.fixture
def make_scheduler(tmp_path: Path) -> Iterator[Callable[..., Scheduler]]:
    """Start schedulers with extra environment (and `engine=`, see Scheduler); all are
    killed and their containers removed at the end of the test."""
    started: list[Scheduler] = []

    def make(start: bool = True, **env: str) -> Scheduler:
        s = Scheduler(tmp_path, **env)
        started.append(s)
        return s.start() if start else s

    yield make
    clean_up_all(started)


@pytest.fixture
def sched(make_scheduler: Callable[..., Scheduler]) -> Scheduler:
    return make_scheduler()


@pytest.fixture(scope="module")
def runpod_server(request: pytest.FixtureRequest) -> Iterator[RunPodEmulator]:
    """One RunPod emulator per test module, taking that module's own `KEY`: each module
    then checks its own key leaks nowhere."""
    with RunPodEmulator(api_key=request.module.KEY) as emulator:
        yield emulator


# How long a new pod takes to run, unless the module says otherwise (`PROVISION_DELAY`):
# a moment, as on RunPod, so that a driver's wait for RUNNING is exercised.
RUNPOD_PROVISION_DELAY = 0.3


@pytest.fixture(name="runpod")
def fresh_runpod(runpod_server: RunPodEmulator, request: pytest.FixtureRequest) -> RunPodEmulator:
    """The module's RunPod emulator as new: no pods, calls, faults or switches; a new pod
    runs `PROVISION_DELAY` seconds after its create (the test module's, if it sets one)."""
    runpod_server.reset()
    delay = getattr(request.module, "PROVISION_DELAY", RUNPOD_PROVISION_DELAY)
    runpod_server.provision_delay = delay
    return runpod_server


@pytest.fixture(name="on_runpod")
def schedulers_on_runpod(
    make_scheduler: Callable[..., Scheduler], runpod: RunPodEmulator
) -> Callable[..., Scheduler]:
    """Start a scheduler process (conftest's `make_scheduler`: cleaned up after the test)
    whose provider is RunPod on transport `api`, pointed at the emulator with its key
    (`key` another): quick to see a pod run, a fresh look at the catalog each time. `env`
    adds to that environment or overrides it (`PROVIDERS` for more providers)."""

    def start(api: str = "rest", *, key: str | None = None, **env: str) -> Scheduler:
        settings = {
            "PROVIDERS": "runpod",
            "RUNPOD_API": api,
            "RUNPOD_API_KEY": key or runpod.api_key,
            "RUNPOD_API_BASE_URL": runpod.base_url,
            "RUNPOD_POLL_INTERVAL_SECONDS": "0.1",
            "RUNPOD_CATALOG_TTL_SECONDS": "0",
            "RUNPOD_REQUEST_TIMEOUT_SECONDS": "10",
        }
        return make_scheduler(**(settings | env))

    return start


@pytest.fixture(scope="module")
def modal_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ModalEmulator]:
    """One Modal emulator per test module, on a Docker network of its own (its log in
    the module's temp directory); every container it made is removed at the end.
    `modal_server.client_env()` is what a process with the `modal` client needs."""
    log = tmp_path_factory.mktemp("modal") / "emulator.log"
    with ModalEmulator(network=f"oa-modal-{uuid.uuid4().hex[:8]}", log_path=log) as emulator:
        yield emulator


@pytest.fixture(scope="module")
def kube_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeEmulator]:
    """One Kubernetes API emulator (with its test kubelet) per test module, on a Docker
    network of its own (its log in the module's temp directory); every container it made
    is removed at the end. `kube_server.kubeconfig_path` is the kubeconfig a client uses."""
    log = tmp_path_factory.mktemp("k8s") / "emulator.log"
    with KubeEmulator(network=f"oa-k8s-{uuid.uuid4().hex[:8]}", log_path=log) as emulator:
        yield emulator


@pytest.fixture(params=["rest", "graphql"])
def api(request: pytest.FixtureRequest) -> str:
    """Each RunPod transport in turn."""
    return str(request.param)


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of this test's own, which it may stop and start."""
    pg = PrivatePostgres()
    try:
        yield pg.init()
    finally:
        pg.destroy()


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    """A fresh, migrated LeaseStore, once on SQLite and once on PostgreSQL."""
    with database_url(request.param, tmp_path) as url:
        s = open_store(url, states=STATE_SETS)
        await s.migrate()
        yield s
        await s.close()


@pytest.fixture
def real_logging() -> Iterator[None]:
    """The service's logging may be set up in this process (configure_logging, as
    `serve` does); it is put back as it was afterwards, the capture of warnings too."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    switches = (
        logging._srcfile,
        logging.logThreads,
        logging.logProcesses,  # type: ignore[attr-defined]
        logging.logMultiprocessing,
    )
    shown = warnings.showwarning
    try:
        yield
    finally:
        logging.captureWarnings(False)
        warnings.showwarning = shown
        root.handlers[:], root.level = handlers, level
        (
            logging._srcfile,
            logging.logThreads,
            logging.logProcesses,  # type: ignore[attr-defined]
            logging.logMultiprocessing,
        ) = switches
