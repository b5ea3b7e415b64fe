"""Run the real service as a separate process and talk to it over real HTTP."""

from __future__ import annotations

import fcntl
import getpass
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import docker
import httpx

from openalice_scheduler.client.core import LIMITS
from openalice_scheduler.store import NewLease
from tests.forked import Forked, run_to_end

REPO = Path(__file__).resolve().parent.parent
# One TLS context for every HTTP client of the tests: httpx makes a new one, loading the
# CA bundle (about 30 ms of CPU), for each client and each top-level `httpx.get`, and
# waiting loops that poll every 50 ms spent most of a core on it. `HTTP` is for the
# plain calls (no secret): a new connection each time, as `httpx.get` makes.
TLS = httpx.create_ssl_context()
HTTP = httpx.Client(verify=TLS, limits=httpx.Limits(max_keepalive_connections=0))
SECRET = "test-secret-" + uuid.uuid4().hex
INSTANCE_LABEL = "openalice.scheduler.instance"
# The demo worker image (conftest builds it from this checkout). TEST_WORKER_IMAGE names
# another tag: a checkout that changes the worker's entry script tests its own build
# without swapping the shared tag under other checkouts' test runs.
WORKER_IMAGE_ENV = "TEST_WORKER_IMAGE"
WORKER_IMAGE = os.environ.get(WORKER_IMAGE_ENV) or "openalice-demo-worker:latest"
SHARED_ENGINE = "unix:///var/run/docker.sock"


# Each test process (a pytest-xdist worker, or a whole session without xdist) takes ports
# from a block of its own, below the kernel's ephemeral range (32768 and up), so that no
# two processes hand the same port to two servers, and no outgoing connection takes one
# between our check and the server binding it. A block is claimed with a lock file held
# for the life of the process (flock: the kernel lets go when the process ends, killed
# too), so two test sessions on one machine (two checkouts, say) never share one either.
_PORT_BLOCK = 1000
_FIRST_PORT = 12000
_BLOCKS = 20  # 12000..31999
_PORT_LOCKS = Path("/tmp/oa-test-ports")
_held_block: list[int] = []  # [block, lock fd], once claimed


def worker_number() -> int:
    """This pytest-xdist worker's number (0 without xdist)."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0


def _first_port() -> int:
    """The first port of this process's block, claimed on first use."""
    if not _held_block:
        _PORT_LOCKS.mkdir(exist_ok=True)
        for i in range(_BLOCKS):
            block = (worker_number() + i) % _BLOCKS
            fd = os.open(_PORT_LOCKS / f"{block}.lock", os.O_CREAT | os.O_RDWR, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # another test process's
                continue
            _held_block.extend((block, fd))
            break
        else:
            raise AssertionError(f"all {_BLOCKS} port blocks are held by other test processes")
    return _FIRST_PORT + _held_block[0] * _PORT_BLOCK


_next_port = 0


def free_port() -> int:
    """A loopback TCP port nothing listens on, from this process's own block."""
    global _next_port
    first = _first_port()
    for _ in range(_PORT_BLOCK):
        port = first + (_next_port % _PORT_BLOCK)
        _next_port += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # a process of an earlier test still holds it
            return port
    raise AssertionError(f"no free port in {first}..{first + _PORT_BLOCK - 1}")


def spawn_command(command: str, env: dict[str, str], log_path: Path, cwd: Path) -> Forked:
    """`openalice-scheduler <command>` as a process of its own (forked with the server
    already imported: tests/forked.py): this process's environment without its OTEL_ and
    RUST_LOG settings, then `env`; its output, unbuffered, appended to `log_path`."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "RUST_LOG"))}
    full.update(env, PYTHONUNBUFFERED="1")
    return Forked(command, full, cwd, log_path, log_path)


def run_serve(
    env: dict[str, str], cwd: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`openalice-scheduler serve` with exactly `env`, run to its end (a start-up that is
    refused, say), what it printed kept as text."""
    return run_to_end("serve", env, cwd, timeout)


def printed_lines(text: str) -> list[str]:
    """The lines of `text` that are not blank."""
    return [line for line in text.splitlines() if line.strip()]


def kill_process(proc: Forked | subprocess.Popen[bytes] | None) -> None:
    """kill -9 `proc` if it still runs, and reap it."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)


def stop_process(proc: Forked | subprocess.Popen[bytes] | None, grace: float) -> None:
    """SIGTERM `proc` if it still runs; kill -9 if it has not ended after `grace` s."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            kill_process(proc)


# The instances of the schedulers this process made on the shared engine, with their
# Docker network: what `sweep_instances` looks for.
STARTED: dict[str, str] = {}

# The Docker network of this process's schedulers on the shared engine, unless a test
# gives one (the instance label keeps their containers apart, as it keeps replicas'
# workers apart on one network in production): a network made and removed costs the
# engine ~0.1-0.15 s of CPU (its bridge and firewall rules), and some 260 schedulers a run
# made one each. Removed at the session's end (`sweep_instances`).
SHARED_NETWORK = f"oa-tests-{os.getpid()}"


class Scheduler:
    """One scheduler process. `env` overrides its environment; the database and instance
    are unique to the test unless given, the Docker network this process's
    (`SHARED_NETWORK`) on the shared engine, the instance's own on another. `engine` is
    the Docker engine its workers run on (the shared one unless given; its DOCKER_HOST
    unless that is given too, a proxy say): its containers are listed and removed there."""

    def __init__(self, workdir: Path, engine: str = SHARED_ENGINE, **env: str) -> None:
        self.workdir = workdir
        self.engine = engine
        if engine != SHARED_ENGINE:
            env.setdefault("DOCKER_HOST", engine)
        # The RunPod emulator's pods are not probed unless a test points RUNPOD_PROXY_URL
        # at the emulator's proxy: nothing else answers for an emulated pod.
        if "RUNPOD_API_BASE_URL" in env and "RUNPOD_PROXY_URL" not in env:
            env.setdefault("RUNPOD_READY_TIMEOUT_SECONDS", "0")
        # The tests' static endpoints are names nobody serves (http://a:8080): they are
        # not probed unless a test says how often (test_static_provider.py does).
        if "STATIC_WORKERS" in env:
            env.setdefault("STATIC_PROBE_INTERVAL_SECONDS", "0")
        self.instance = env.pop("SCHEDULER_INSTANCE", f"t-{uuid.uuid4().hex[:10]}")
        self.port = free_port()
        self.env = {
            "INTERNAL_SECRET": SECRET,
            "SCHEDULER_HOST": "127.0.0.1",
            "SCHEDULER_INSTANCE": self.instance,
            "DATABASE_URL": f"sqlite:///{workdir / (self.instance + '.db')}",
            "DOCKER_NETWORK": SHARED_NETWORK if engine == SHARED_ENGINE else f"oa-{self.instance}",
            "RENDERER_IMAGE": WORKER_IMAGE,
            "ANIM_IMAGE": WORKER_IMAGE,
            "LOCAL_GPU_DEVICES": "",
            "RUST_LOG": "info",
            **env,
        }
        if engine == SHARED_ENGINE:
            STARTED[self.instance] = self.env["DOCKER_NETWORK"]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: Forked | None = None
        self.log_path = workdir / f"scheduler-{self.instance}.log"
        self.http = httpx.Client(
            verify=TLS,
            base_url=self.url,
            headers={"X-Internal-Secret": SECRET},
            timeout=60,
            limits=LIMITS,  # as the client's: never a connection the service is closing
        )

    # --- process ---------------------------------------------------------------------

    def start(self, wait: bool = True) -> Scheduler:
        env = {**self.env, "SCHEDULER_PORT": str(self.port)}
        self.proc = spawn_command("serve", env, self.log_path, self.workdir)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        def answers() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise _Exited(f"scheduler exited {self.proc.returncode}:\n{self.log()}")
            try:
                # With the secret: another scheduler on the port (of another test session
                # on this machine) answers 401, this one anything else (a 503 too, its
                # store down: some tests want that).
                return (
                    self.http.get("/v1/leases", params={"limit": 1}, timeout=1).status_code != 401
                )
            except httpx.HTTPError:
                return False

        try:
            wait_for(answers, timeout, what="the scheduler to answer")
        except _Exited as exited:
            raise AssertionError(str(exited)) from None
        except AssertionError:
            raise AssertionError(f"scheduler not ready in {timeout}s:\n{self.log()}") from None

    def kill(self) -> None:
        """kill -9: no shutdown code runs."""
        kill_process(self.proc)

    def stop(self) -> None:
        stop_process(self.proc, grace=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # --- API -------------------------------------------------------------------------

    def acquire(self, **body: Any) -> httpx.Response:
        body.setdefault("kind", "renderer")
        return self.http.post("/v1/lease", json=body)

    def lease(self, **body: Any) -> dict[str, Any]:
        response = self.acquire(**body)
        assert response.status_code == 200, response.text
        return response.json()["lease"]

    def release(self, lease_id: str, owner: str | None = None) -> httpx.Response:
        headers = {"X-Lease-Owner": owner} if owner else {}
        return self.http.delete(f"/v1/lease/{lease_id}", headers=headers)

    def leases(self) -> list[dict[str, Any]]:
        response = self.http.get("/v1/leases")
        assert response.status_code == 200, response.text
        return response.json()

    def metric(self, name: str, **labels: str) -> float:
        """Value of one sample of /metrics (0 when absent)."""
        text = HTTP.get(f"{self.url}/metrics", timeout=60).text
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            key, _, value = line.rpartition(" ")
            series, _, rest = key.partition("{")
            got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
            if series == name and got == want:
                return float(value)
        return 0.0

    # --- Docker ----------------------------------------------------------------------

    def containers(self, all: bool = True) -> list[Any]:
        return list_containers(
            docker_client(self.engine),
            all=all,
            filters={"label": f"{INSTANCE_LABEL}={self.instance}"},
        )

    def cleanup(self) -> None:
        self.kill()
        self.http.close()
        remove_instance(self.instance, self.env["DOCKER_NETWORK"], self.engine)


def clean_up_all(schedulers: list[Scheduler]) -> None:
    """Kill every one of `schedulers`, then clean each up: one still running (a replica
    sharing the instance's network, say) would make the network again once an earlier
    one's cleanup removed it."""
    for s in schedulers:
        s.kill()
    for s in schedulers:
        s.cleanup()


_clients: dict[str, docker.DockerClient] = {}


def docker_client(engine: str = SHARED_ENGINE) -> docker.DockerClient:
    if engine not in _clients:
        _clients[engine] = docker.DockerClient(base_url=engine, version="1.41", timeout=120)
    return _clients[engine]


@contextmanager
def engine_events(
    filters: dict[str, Any], on_event: Callable[[dict[str, Any]], None], since: int | None = None
) -> Iterator[None]:
    """While the block runs, `on_event(event)` for each event of the shared engine that
    matches `filters` (from `since`, unix seconds, if given: the engine's buffer replays
    what came while the stream was being opened), called from a thread of its own that
    reads the stream on a client of its own."""
    client = docker.DockerClient(base_url=SHARED_ENGINE, version="1.41")
    stream = client.events(since=since, decode=True, filters=filters)

    def read() -> None:
        with suppress(Exception):  # the stream closed under it, at the end
            for event in stream:
                on_event(event)

    reader = threading.Thread(target=read, name="engine-events", daemon=True)
    reader.start()
    try:
        yield
    finally:
        stream.close()
        reader.join(10)
        client.close()


def list_containers(client: docker.DockerClient, **filters: Any) -> list[Any]:
    """`client.containers.list(**filters)` without its race: the SDK lists, then inspects
    each container, and one removed in between (by the scheduler under test, say) made
    the whole listing fail with 404. Such a container is simply not listed."""
    found = []
    for sparse in client.containers.list(sparse=True, **filters):
        with suppress(docker.errors.NotFound):
            found.append(client.containers.get(sparse.id))
    return found


def printed_in(container: Any, argv: list[str], tries: int = 5) -> bytes:
    """What `argv`, run in `container` (`docker exec`), printed: for a command that always
    prints something. A loaded engine (Docker 20.10 here) now and then answers an exec
    with its exit code 0 and none of its output, the streams copied after the process
    ended (moby/moby#27289's kind; seen once each in full runs of test_warm_pool.py and
    of test_image.py): such an answer is asked again, up to `tries` times. An exec that
    fails fails the test, with what it printed."""
    for _ in range(tries):
        result = container.exec_run(argv)
        assert result.exit_code == 0, f"{argv} exited {result.exit_code}: {result.output!r}"
        if result.output:
            return bytes(result.output)
    raise AssertionError(f"{argv} exited 0 and printed nothing, {tries} times")


def remove_instance(instance: str, network: str | None = None, engine: str = SHARED_ENGINE) -> None:
    """Remove the instance's containers on `engine`, then `network` there, unless it is
    this process's shared one on the shared engine (`sweep_instances` removes that)."""
    client = docker_client(engine)
    for container in list_containers(
        client, all=True, filters={"label": f"{INSTANCE_LABEL}={instance}"}
    ):
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            # The scheduler is removing it itself (a dead worker's remains): gone soon.
            if exc.status_code != 409:
                raise
    if network and (network, engine) != (SHARED_NETWORK, SHARED_ENGINE):
        _remove_network(client, network)


def _remove_network(client: docker.DockerClient, network: str) -> None:
    """Remove the network named exactly `network` (the engine lists by prefix), if any."""
    for net in client.networks.list(names=[network]):
        if net.name == network:
            with suppress(docker.errors.APIError):
                net.remove()


def sweep_instances() -> None:
    """Remove what a scheduler of this process (`STARTED`) still has on the shared engine,
    its networks too, then this process's network: called at the end of the session. A
    scheduler killed at a test's end with a Docker call in flight (a pool's refill, say)
    leaves it to dockerd, which may make the container, or the network, after the test's
    `remove_instance` looked; by the session's end it has."""
    client = docker_client()
    left = {
        sparse.attrs["Labels"].get(INSTANCE_LABEL)
        for sparse in client.containers.list(
            all=True, sparse=True, filters={"label": INSTANCE_LABEL}
        )
    }
    for instance in left & STARTED.keys():
        remove_instance(instance, STARTED[instance])
    for network in client.networks.list(filters={"label": INSTANCE_LABEL}):
        if network.attrs["Labels"].get(INSTANCE_LABEL) in STARTED:
            with suppress(docker.errors.APIError):
                network.remove()
    _remove_network(client, SHARED_NETWORK)


class _Exited(Exception):
    """The scheduler process ended while `wait_ready` waited for it."""


def wait_for(predicate: Any, timeout: float, interval: float = 0.05, what: str = "") -> Any:
    """Poll `predicate` until it returns something true (returned), else fail after
    `timeout` seconds. The suite's one shared poll: for a condition that only shows by
    being looked at (another process's state, a container, a file), where nothing can
    be awaited. An async test runs it off its loop, `await asyncio.to_thread(wait_for,
    ...)`, so that the code under test runs meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        # sleep: the pause between two looks of the poll; what is polled has no event.
        time.sleep(interval)


def fetch_in_network(network: str, url: str) -> str:
    """GET `url` from a throw-away container on `network`: what a caller inside the
    network sees (the host never talks to container addresses)."""
    out = docker_client().containers.run(
        # busybox 1.35's wget crashes when given -T: bound it with `timeout` instead.
        WORKER_IMAGE,
        ["/bin/busybox", "timeout", "10", "/bin/busybox", "wget", "-q", "-O", "-", url],
        network=network,
        remove=True,
        labels={INSTANCE_LABEL: "probe"},
    )
    return out.decode()


PG_HOST = os.environ.get("OPENALICE_TEST_PGHOST", "/var/run/postgresql")


@contextmanager
def database_url(kind: str, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of `kind` (sqlite or postgresql) for one test."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'state.db'}"
        return
    name = f"oa_test_{uuid.uuid4().hex[:12]}"
    subprocess.run(
        ["psql", "-h", PG_HOST, "-d", "postgres", "-qc", f"CREATE DATABASE {name}"],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://{getpass.getuser()}@/{name}?host={PG_HOST}"
    finally:
        subprocess.run(
            [
                "psql",
                "-h",
                PG_HOST,
                "-d",
                "postgres",
                "-qc",
                f"DROP DATABASE IF EXISTS {name} WITH (FORCE)",
            ],
            capture_output=True,
        )


def on_static(
    make_scheduler: Callable[..., Scheduler], workers: str = "renderer=http://only:8080", **env: str
) -> Scheduler:
    """A scheduler (`make_scheduler`, the fixture) whose one provider is a static pool of
    `workers`: endpoints that are never created nor destroyed, only leased."""
    return make_scheduler(PROVIDERS="static", STATIC_WORKERS=workers, **env)


def flags(**options: str) -> list[str]:
    """`--name value` for each option, as a command line gives them (`correlation_id`
    is `--correlation-id`)."""
    return [
        word for name, value in options.items() for word in (f"--{name.replace('_', '-')}", value)
    ]


@contextmanager
def scheduler(workdir: Path, **env: str) -> Iterator[Scheduler]:
    s = Scheduler(workdir, **env).start()
    try:
        yield s
    finally:
        s.cleanup()


def json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def new_lease_at(now: int, ttl_seconds: int = 60, **request: str | None) -> NewLease:
    """A new lease as the store is handed it: made at `now` (µs since the epoch), expiring
    `ttl_seconds` later; a renderer without a GPU, owner, correlation id or region unless
    `request` says (NewLease's own names: kind, gpu, owner_id, correlation_id, region)."""
    asked = {"kind": "renderer", "gpu": "none", "owner_id": None, "correlation_id": None}
    return NewLease(
        lease_id=str(uuid.uuid4()),
        ttl_seconds=ttl_seconds,
        created_at=now,
        expires_at=now + ttl_seconds * 1_000_000,
        **{**asked, "region": None, **request},  # type: ignore[arg-type]
    )
