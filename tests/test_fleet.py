"""local-docker over a fleet of real Docker engines (DOCKER_HOSTS): two dockerd
processes of the tests' own, each in its own network namespace with a no-op GPU hook,
one scheduler placing workers on both."""

from __future__ import annotations

import os
import re
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from openalice_scheduler.config import Settings
from openalice_scheduler.providers import configuration_problems
from openalice_scheduler.providers.docker.hosts import HostConfig, parse_hosts
from tests.dockerproxy import DockerProxy
from tests.engines import PrivateEngine, make_tls_files
from tests.harness import (
    INSTANCE_LABEL,
    SECRET,
    WORKER_IMAGE,
    Scheduler,
    database_url,
    remove_instance,
    wait_for,
)
from tests.loss import lost
from tests.sshd import PrivateSshd

LEASE_LABEL = "openalice.scheduler.lease_id"
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's ca-certificates
MakeFleet = Callable[..., Scheduler]  # (DOCKER_HOSTS, **env)


@pytest.fixture(scope="module")
def second_engine(gpu_engine: PrivateEngine) -> Iterator[PrivateEngine]:
    """A second GPU-shimmed engine beside the session's `gpu_engine`; this module's own,
    so that a test may stop it."""
    with PrivateEngine(gpu_shim=True) as engine:
        yield engine


@pytest.fixture
def engines(gpu_engine: PrivateEngine, second_engine: PrivateEngine) -> dict[str, PrivateEngine]:
    return {"gpu1": gpu_engine, "gpu2": second_engine}


@pytest.fixture
def make_fleet(
    make_scheduler: Callable[..., Scheduler], engines: dict[str, PrivateEngine]
) -> Iterator[MakeFleet]:
    """A scheduler over both engines; `hosts` is DOCKER_HOSTS with {gpu1} and {gpu2}
    standing for the engines' addresses. Its containers are removed from both at the end."""
    made: list[Scheduler] = []

    def make(hosts: str, **env: str) -> Scheduler:
        where = {name: engine.url for name, engine in engines.items()}
        s = make_scheduler(DOCKER_HOSTS=hosts.format(**where), **env)
        made.append(s)
        return s

    yield make
    for s in made:
        s.kill()
        for engine in engines.values():
            if engine.engine is not None and engine.engine.answers():
                remove_instance(s.instance, s.env["DOCKER_NETWORK"], engine.url)


def on_engine(engine: PrivateEngine, s: Scheduler) -> list[str]:
    """The lease ids of the scheduler's containers on `engine`."""
    return sorted(c.labels[LEASE_LABEL] for c in engine.containers(s.instance))


def hosts_of(leases: list[dict[str, Any]]) -> list[str]:
    return [lease["host"] for lease in leases]


def fleet_view(s: Scheduler) -> dict[str, Any]:
    response = s.http.get("/v1/providers")
    assert response.status_code == 200, response.text
    return next(p for p in response.json() if p["name"] == "local-docker")


def state_of(s: Scheduler, lease: dict[str, Any]) -> str:
    response = s.http.get(f"/v1/lease/{lease['lease_id']}")
    assert response.status_code == 200, response.text
    return str(response.json()["state"])


def test_leases_go_to_the_least_loaded_host_within_each_hosts_cap(
    make_fleet: MakeFleet, engines: dict[str, PrivateEngine]
) -> None:
    s = make_fleet("gpu1={gpu1} max=2; gpu2={gpu2} max=3")
    leases = [s.lease(kind="renderer") for _ in range(5)]
    # Least loaded first, ties in declared order; gpu1 is full after two.
    assert hosts_of(leases) == ["gpu1", "gpu2", "gpu1", "gpu2", "gpu2"]
    by_host = {
        name: sorted(lease["lease_id"] for lease in leases if lease["host"] == name)
        for name in engines
    }
    for name, engine in engines.items():
        assert on_engine(engine, s) == by_host[name], name

    # GET /v1/providers: each host's health, capacity and use.
    view = fleet_view(s)
    assert (view["max_workers"], view["in_use"]) == (5, 5)
    assert view["hosts"] == [
        {
            "name": "gpu1",
            "healthy": True,
            "detail": "",
            "region": None,
            "max_workers": 2,
            "gpu_devices": [],
            "workers": 2,
        },
        {
            "name": "gpu2",
            "healthy": True,
            "detail": "",
            "region": None,
            "max_workers": 3,
            "gpu_devices": [],
            "workers": 3,
        },
    ]

    full = s.acquire(kind="renderer")
    assert full.status_code == 503, full.text
    assert full.json()["error"] == "no_provider_available"
    assert "gpu1 2/2" in full.text and "gpu2 3/3" in full.text

    # A slot freed on gpu1 is where the next lease goes, and its worker is made there.
    gone = next(lease for lease in leases if lease["host"] == "gpu1")
    assert s.release(gone["lease_id"]).status_code == 204
    assert gone["lease_id"] not in on_engine(engines["gpu1"], s)
    again = s.lease(kind="anim")
    assert again["host"] == "gpu1"
    assert again["lease_id"] in on_engine(engines["gpu1"], s)
    assert s.http.get(f"/v1/lease/{again['lease_id']}").json()["host"] == "gpu1"


def test_each_gpu_of_each_host_is_leased_to_one_lease_at_a_time(
    make_fleet: MakeFleet, engines: dict[str, PrivateEngine]
) -> None:
    s = make_fleet("gpu1={gpu1} gpus=0,1 max=3; gpu2={gpu2} gpus=0 max=3")
    gpu_leases = [s.lease(kind="renderer", gpu="entry") for _ in range(3)]
    assert hosts_of(gpu_leases) == ["gpu1", "gpu2", "gpu1"]

    # What each engine was asked for: gpu1 both its devices, gpu2 its one.
    def devices(engine: PrivateEngine) -> list[str]:
        return sorted(
            device
            for c in engine.containers(s.instance)
            for request in c.attrs["HostConfig"]["DeviceRequests"] or []
            for device in request["DeviceIDs"]
        )

    assert devices(engines["gpu1"]) == ["0", "1"]
    assert devices(engines["gpu2"]) == ["0"]

    refused = s.acquire(kind="renderer", gpu="entry")
    assert refused.status_code == 503, refused.text
    assert "no Docker host has a free GPU device" in refused.text
    # A CPU worker still fits: gpu2 has free slots, and is the less loaded.
    assert s.lease(kind="anim")["host"] == "gpu2"

    # gpu2's device freed: the next GPU lease takes it, on gpu2.
    on_gpu2 = next(lease for lease in gpu_leases if lease["host"] == "gpu2")
    assert s.release(on_gpu2["lease_id"]).status_code == 204
    assert s.lease(kind="renderer", gpu="entry")["host"] == "gpu2"
    assert devices(engines["gpu2"]) == ["0"]


def test_caps_and_gpus_of_each_host_hold_across_two_replicas(
    make_fleet: MakeFleet, engines: dict[str, PrivateEngine], tmp_path: Path
) -> None:
    hosts = "gpu1={gpu1} gpus=0,1 max=3; gpu2={gpu2} gpus=0 max=2"
    with database_url("postgresql", tmp_path) as url:
        first = make_fleet(hosts, DATABASE_URL=url)
        second = make_fleet(
            hosts,
            DATABASE_URL=url,
            SCHEDULER_INSTANCE=first.instance,
            DOCKER_NETWORK=first.env["DOCKER_NETWORK"],
        )
        # 12 acquires at once, half on each replica, half of them for a GPU: 5 slots.
        asks = [(replica, gpu) for replica in (first, second) for gpu in ("entry", "none") * 3]
        with ThreadPoolExecutor(len(asks)) as pool:
            answers = list(pool.map(lambda ask: ask[0].acquire(kind="renderer", gpu=ask[1]), asks))
        granted = [a.json()["lease"] for a in answers if a.status_code == 200]
        assert sorted({a.status_code for a in answers}) == [200, 503], [a.text for a in answers]
        assert len(granted) == 5
        assert sum(h == "gpu1" for h in hosts_of(granted)) == 3
        assert sum(h == "gpu2" for h in hosts_of(granted)) == 2
        # On the engines themselves: each host's cap, and each GPU to one worker at most.
        assert len(on_engine(engines["gpu1"], first)) == 3
        assert len(on_engine(engines["gpu2"], first)) == 2
        for engine in engines.values():
            devices = [
                device
                for c in engine.containers(first.instance)
                for request in c.attrs["HostConfig"]["DeviceRequests"] or []
                for device in request["DeviceIDs"]
            ]
            assert len(devices) == len(set(devices)), devices
        for s in (first, second):
            s.kill()


def test_a_region_picks_the_hosts_of_that_region(make_fleet: MakeFleet) -> None:
    s = make_fleet("gpu1={gpu1} region=eu; gpu2={gpu2} region=us")
    assert s.lease(kind="renderer", region="us")["host"] == "gpu2"
    assert s.lease(kind="renderer", region="us")["host"] == "gpu2"
    assert s.lease(kind="renderer", region="eu")["host"] == "gpu1"
    unknown = s.acquire(kind="renderer", region="ap")
    assert unknown.status_code == 503, unknown.text
    assert "'eu', 'us'" in unknown.json()["reasons"]["local-docker"]


@pytest.fixture(scope="module")
def tls_engine() -> Iterator[PrivateEngine]:
    """An engine reached over TCP with TLS, verifying its callers (`dockerd --tlsverify`),
    as a remote GPU host is."""
    with PrivateEngine(tls=True) as engine:
        yield engine


def test_a_tls_engine_is_a_fleet_host_and_both_ends_are_verified(
    make_scheduler: Callable[..., Scheduler], tls_engine: PrivateEngine, tmp_path: Path
) -> None:
    """`name=tcp://host:2376 tls=DIR`: the worker is made on that engine over TLS, handed
    out once it answers there, and destroyed on release. Client files from another
    certificate authority are refused by the engine (and the engine's certificate by the
    scheduler): the host is unhealthy, no worker is made, the caller is told why."""
    # A CA bundle in the environment, as many hosts and images have, must not stand in
    # for the engine's own CA.
    good = make_scheduler(
        DOCKER_HOSTS=f"tls1={tls_engine.tcp_url} tls={tls_engine.tls_dir} max=2",
        REQUESTS_CA_BUNDLE=SYSTEM_CA_BUNDLE,
    )
    try:
        lease = good.lease(kind="renderer")
        assert lease["host"] == "tls1"
        assert on_engine(tls_engine, good) == [lease["lease_id"]]
        [container] = tls_engine.containers(good.instance)
        assert container.status == "running"
        view = fleet_view(good)
        assert [(h["name"], h["healthy"]) for h in view["hosts"]] == [("tls1", True)]
        assert good.release(lease["lease_id"]).status_code == 204
        assert on_engine(tls_engine, good) == []
    finally:
        remove_instance(good.instance, good.env["DOCKER_NETWORK"], tls_engine.url)

    strangers = make_tls_files(tmp_path / "other-ca", tls_engine.route.engine_end)
    bad = make_scheduler(DOCKER_HOSTS=f"tls1={tls_engine.tcp_url} tls={strangers}")
    answer = bad.acquire(kind="renderer")
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"] == "no_provider_available"
    assert "tls1: TLS with the Docker engine at" in answer.json()["message"], answer.text
    [host] = fleet_view(bad)["hosts"]
    assert host["healthy"] is False
    assert "TLS" in host["detail"], host
    assert tls_engine.containers(bad.instance) == []


@pytest.fixture(scope="module")
def ssh_host(gpu_engine: PrivateEngine) -> Iterator[PrivateSshd]:
    """The session's `gpu_engine`, reached through an SSH server as a remote host is."""
    server = PrivateSshd(docker_host=gpu_engine.url)
    try:
        yield server.start()
    finally:
        server.destroy()


def test_an_ssh_engine_is_a_fleet_host(
    make_scheduler: Callable[..., Scheduler], ssh_host: PrivateSshd, gpu_engine: PrivateEngine
) -> None:
    """`name=ssh://user@host`: the scheduler's `ssh` (its keys, its known_hosts) runs
    `docker system dial-stdio` on the host, and the worker is made, handed out once it
    answers, and destroyed there."""
    s = make_scheduler(
        DOCKER_HOSTS=f"ssh1={ssh_host.url} max=2",
        PATH=f"{ssh_host.client_bin}:{os.environ['PATH']}",
    )
    try:
        lease = s.lease(kind="anim")
        assert lease["host"] == "ssh1"
        assert on_engine(gpu_engine, s) == [lease["lease_id"]], ssh_host.log()[-2000:]
        assert [(h["name"], h["healthy"]) for h in fleet_view(s)["hosts"]] == [("ssh1", True)]
        assert s.release(lease["lease_id"]).status_code == 204
        assert on_engine(gpu_engine, s) == []
        assert f"Accepted publickey for {ssh_host.user}" in ssh_host.log()  # through sshd
    finally:
        remove_instance(s.instance, s.env["DOCKER_NETWORK"], gpu_engine.url)


def test_a_slow_ssh_host_serves_the_first_acquire_after_a_start(
    make_scheduler: Callable[..., Scheduler], gpu_engine: PrivateEngine
) -> None:
    """Regression: the first acquire after a start refused a host reached through ssh
    that had answered the start-up reconciliation, because its first ping was slow ("has
    not answered yet", 503; seen on a loaded machine). Any answer counts: here the first
    ssh connection after the start (the first ping's) takes 4 s, longer than a ping may."""
    slow = PrivateSshd(docker_host=gpu_engine.url, delay=4.0).start()
    try:
        s = make_scheduler(
            DOCKER_HOSTS=f"far={slow.url} max=1",
            PATH=f"{slow.client_bin}:{os.environ['PATH']}",
        )
        slow.slow_next()
        try:
            lease = s.lease(kind="anim")
            assert lease["host"] == "far"
            assert s.release(lease["lease_id"]).status_code == 204
        finally:
            remove_instance(s.instance, s.env["DOCKER_NETWORK"], gpu_engine.url)
    finally:
        slow.destroy()


def test_a_bad_docker_hosts_is_refused_at_start_naming_each_problem(
    make_scheduler: Callable[..., Scheduler],
) -> None:
    s = make_scheduler(
        start=False,
        DOCKER_HOSTS="gpu1=tcp://10.0.0.5 gpus=0; gpu2=x",
        LOCAL_DOCKER_REGION="eu",
        SWEEP_INTERVAL_SECONDS="0",
    )
    s.start(wait=False)
    assert s.proc is not None
    assert s.proc.wait(60) == 2
    lines = [line for line in s.log().splitlines() if "invalid configuration" in line]
    assert any(
        "DOCKER_HOSTS: host 'gpu1': address 'tcp://10.0.0.5' needs a port" in line for line in lines
    ), lines
    assert any("LOCAL_DOCKER_REGION: not used with DOCKER_HOSTS" in line for line in lines)
    # Reported with the settings' own errors, all at once.
    assert any("SWEEP_INTERVAL_SECONDS" in line for line in lines), lines


@pytest.mark.timeout(300)
def test_an_unreachable_engine_is_skipped_and_its_release_finishes_once_it_is_back(
    make_fleet: MakeFleet, engines: dict[str, PrivateEngine]
) -> None:
    # gpu2 is reached through a proxy that can cut it off, as a host whose network is
    # gone: its engine and its workers run on, unseen (no event, no listing). (A short
    # path: a unix socket's is 107 bytes at most.)
    where = Path(tempfile.mkdtemp(prefix="oa-cut-", dir="/tmp"))
    with DockerProxy(where / "gpu2.sock", engines["gpu2"].sock).start() as cut:
        s = make_fleet(
            f"gpu1={{gpu1}} max=3; gpu2={cut.url} max=3",
            SWEEP_INTERVAL_SECONDS="1",
            RECONCILE_INTERVAL_SECONDS="1",
        )
        unreachable_engine_is_skipped(s, engines, cut)


def unreachable_engine_is_skipped(
    s: Scheduler, engines: dict[str, PrivateEngine], cut: DockerProxy
) -> None:
    leases = [s.lease(kind="renderer") for _ in range(4)]
    assert hosts_of(leases) == ["gpu1", "gpu2", "gpu1", "gpu2"]
    kept, doomed = leases[1], leases[3]

    def state(lease: dict[str, Any]) -> str:
        return state_of(s, lease)

    # Traffic while gpu2 goes: acquire and release, one slot of each host free.
    traffic: list[tuple[int, dict[str, Any] | None]] = []
    stopping = threading.Event()

    def pairs() -> None:
        while not stopping.is_set():
            answer = s.acquire(kind="anim")
            lease = answer.json().get("lease")
            traffic.append((answer.status_code, lease))
            if lease is not None:
                traffic.append((s.release(lease["lease_id"]).status_code, lease))

    worker = threading.Thread(target=pairs)
    worker.start()
    try:
        wait_for(lambda: len(traffic) >= 4, 60, what="some traffic")
        cut.stop()
        wait_for(lambda: not fleet_view(s)["hosts"][1]["healthy"], 30, what="gpu2 seen unreachable")
    finally:
        stopping.set()
        worker.join(120)
    # Refusals and failures while it went away, never a 500.
    assert traffic and {code for code, _ in traffic} <= {200, 204, 502, 503}, traffic
    try:
        # Traffic goes on, on gpu1 alone: gpu2 is skipped, never tried.
        for _ in range(5):
            lease = s.lease(kind="anim")
            assert lease["host"] == "gpu1"
            assert s.release(lease["lease_id"]).status_code == 204
        # A release on gpu2 cannot be confirmed: the lease stays releasing, retried.
        failed = s.release(doomed["lease_id"])
        assert failed.status_code == 502, failed.text
        assert failed.json()["error"] == "release_failed"
        assert state(doomed) == "releasing"
        # gpu2's other lease keeps its state: its worker is unseen, not dead.
        assert state(kept) == "active"
        assert s.lease(kind="renderer")["host"] == "gpu1"
        full = s.acquire(kind="renderer")  # gpu1 is full and gpu2 down: no room
        assert full.status_code == 503, full.text
        assert "gpu2" in full.json()["reasons"]["local-docker"]
        view = fleet_view(s)
        assert view["healthy"] is True and "gpu2" in view["detail"]
        gpu1, gpu2 = view["hosts"]
        assert (gpu1["healthy"], gpu1["workers"]) == (True, 3)
        assert (gpu2["healthy"], gpu2["workers"]) == (False, None)
        assert "unreachable" in gpu2["detail"]
    finally:
        cut.start()

    # Back: the sweeper finishes the release there on its own, and gpu2 serves again;
    # the worker that ran on unseen still holds its lease (its event stream and the
    # listings say it lives).
    wait_for(lambda: state(doomed) == "released", 90, interval=0.5, what="the retried release")
    assert doomed["lease_id"] not in on_engine(engines["gpu2"], s)
    assert kept["lease_id"] in on_engine(engines["gpu2"], s)
    back = wait_for(
        lambda: s.acquire(kind="renderer").json().get("lease"),
        30,
        interval=0.5,
        what="an acquire placed on gpu2 again",
    )
    assert back["host"] == "gpu2"
    assert state(kept) == "active"

    # Nothing of the traffic is left: each of its leases ended, and its workers with it
    # (a release cut off is retried, a worker half-made on gpu2 destroyed as an orphan).
    made = {lease["lease_id"]: lease for _, lease in traffic if lease is not None}
    wait_for(
        lambda: (
            all(state(lease) in ("released", "failed") for lease in made.values())
            and not set(made) & {*on_engine(engines["gpu1"], s), *on_engine(engines["gpu2"], s)}
        ),
        90,
        interval=0.5,
        what="the traffic's leases and workers gone",
    )


@pytest.mark.timeout(300)
def test_after_kill_9_each_host_is_reconciled_once_it_answers(
    make_fleet: MakeFleet, engines: dict[str, PrivateEngine]
) -> None:
    hosts = "gpu1={gpu1}; gpu2={gpu2}"
    s = make_fleet(hosts)
    leases = [s.lease(kind="renderer") for _ in range(4)]
    assert hosts_of(leases) == ["gpu1", "gpu2", "gpu1", "gpu2"]
    s.kill()  # kill -9: nothing of the scheduler runs any more

    # Meanwhile a worker vanishes on each host, and an orphan appears on gpu2 (a worker
    # with this scheduler's labels that no lease of its store holds).
    gpu1, gpu2 = engines["gpu1"], engines["gpu2"]
    gpu1.client.containers.get(container_of(gpu1, s, leases[2])).remove(force=True)
    gpu2.client.containers.get(container_of(gpu2, s, leases[1])).remove(force=True)
    gpu2.client.containers.run(
        WORKER_IMAGE,
        detach=True,
        labels={INSTANCE_LABEL: s.instance, LEASE_LABEL: str(uuid.uuid4())},
    )
    down = gpu2.engine
    assert down is not None
    down.stop()
    try:
        # The scheduler again, on the same store, while gpu2 does not answer.
        again = make_fleet(
            hosts,
            SCHEDULER_INSTANCE=s.instance,
            DATABASE_URL=s.env["DATABASE_URL"],
            DOCKER_NETWORK=s.env["DOCKER_NETWORK"],
            RECONCILE_INTERVAL_SECONDS="1",
        )
        wait_for(
            lambda: state_of(again, leases[2]) == "released",
            60,
            interval=0.5,
            what="gpu1's vanished worker marked lost",
        )
        assert (
            again.http.get(f"/v1/lease/{leases[2]['lease_id']}").json()["release_reason"] == "lost"
        )
        # gpu2's leases are left as they are while it cannot be looked at.
        assert [state_of(again, lease) for lease in leases] == [
            "active",
            "active",
            "released",
            "active",
        ]
    finally:
        if not down.answers():
            down.start()

    # gpu2 back: its vanished worker's lease is marked lost, its orphan destroyed; and
    # the worker its engine stopped on the way down (dockerd stops its containers) ends
    # its lease too, `lost` as it `exited`, its container removed: a lease means a worker.
    wait_for(
        lambda: state_of(again, leases[1]) == state_of(again, leases[3]) == "released",
        60,
        interval=0.5,
        what="gpu2's vanished and stopped workers marked lost",
    )
    wait_for(
        lambda: not gpu2.containers(s.instance),
        60,
        interval=0.5,
        what="gpu2's orphan and stopped worker destroyed",
    )
    assert [state_of(again, lease) for lease in leases] == [
        "active",
        "released",
        "released",
        "released",
    ]
    ended = [again.http.get(f"/v1/lease/{lease['lease_id']}").json() for lease in leases[1:]]
    assert [(e["release_reason"], e["lost_cause"]) for e in ended] == [
        ("lost", "unknown"),
        ("lost", "unknown"),
        ("lost", "exited"),
    ]
    assert on_engine(gpu1, again) == [leases[0]["lease_id"]]


def container_of(engine: PrivateEngine, s: Scheduler, lease: dict[str, Any]) -> str:
    return next(
        c.id for c in engine.containers(s.instance) if c.labels[LEASE_LABEL] == lease["lease_id"]
    )


@pytest.mark.parametrize(
    ("hosts", "problem"),
    [
        (" ; ", "names no host"),
        ("GPU1=unix:///x.sock", "must start name=address"),
        ("gpu1=unix:///x.sock; gpu1=unix:///y.sock", "host 'gpu1' is declared twice"),
        ("gpu1=http://10.0.0.5:2375", "must be unix:///path/docker.sock"),
        ("gpu1=tcp://10.0.0.5:x", "has a port that is not a number"),
        ("gpu1=unix:///x.sock cpus=4", "unknown option 'cpus=4'"),
        ("gpu1=unix:///x.sock gpus=0,0", "a GPU is listed twice"),
        ("gpu1=unix:///x.sock gpus=0;1", "must start name=address"),
        ("gpu1=unix:///x.sock max=-1", "max= must be a number ≥ 0"),
        ("gpu1=unix:///x.sock price=nan", "price= must be a number ≥ 0"),
        ("gpu1=unix:///x.sock tls=/etc", "tls= is for tcp:// addresses"),
        ("gpu1=tcp://10.0.0.5:2376 tls=/nonexistent", "lacks ca.pem, cert.pem, key.pem"),
    ],
)
def test_each_docker_hosts_mistake_is_named(hosts: str, problem: str) -> None:
    settings = Settings(internal_secret=SECRET, docker_hosts=hosts)  # type: ignore[call-arg]
    problems = configuration_problems(settings)
    assert len(problems) == 1 and problems[0].startswith("DOCKER_HOSTS: "), problems
    assert problem in problems[0]


def test_the_docs_two_gpu_hosts_parse_as_declared(tmp_path: Path) -> None:
    """The DOCKER_HOSTS example of docs/backends/docker.md#a-fleet-of-docker-hosts, read
    from the page, its two GPU hosts with their TLS directory made here."""
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("test")
    page = (Path(__file__).resolve().parents[1] / "docs/backends/docker.md").read_text()
    [declared] = re.findall(r"^DOCKER_HOSTS='([^']*)'", page, flags=re.MULTILINE)
    gpu_hosts = [host.strip() for host in declared.split(";") if host.strip().startswith("gpu")]
    hosts = parse_hosts(";".join(re.sub(r"tls=\S+", f"tls={tmp_path}", host) for host in gpu_hosts))
    assert hosts == [
        # No price=: LOCAL_DOCKER_PRICE_PER_HOUR's price for each class
        # (docs/concepts/money.md#prices-and-caps).
        HostConfig("gpu1", "tcp://10.0.0.5:2376", ("0", "1"), 4, "eu", None, str(tmp_path)),
        HostConfig("gpu2", "ssh://ops@10.0.0.6", ("0",), 2, "eu", 0.4, None),
    ]


async def test_a_fleet_lease_is_priced_at_its_own_hosts_price() -> None:
    """A host's price= is what its workers cost, whatever the class; a host without one
    costs LOCAL_DOCKER_PRICE_PER_HOUR's price for the class. The policy sees the
    cheapest answering host; the lease records the host it was placed on."""
    from datetime import UTC, datetime

    from openalice_scheduler.models import GpuClass, WorkerKind
    from openalice_scheduler.providers import WorkerSpec
    from openalice_scheduler.providers.docker import DockerFleetProvider

    settings = Settings(  # type: ignore[call-arg]
        internal_secret=SECRET,
        local_docker_price_per_hour="none=0.25,entry=0.5",
        docker_hosts="dear=unix:///nonexistent/a.sock price=0.9 gpus=0; "
        "plain=unix:///nonexistent/b.sock gpus=1",
    )
    fleet = DockerFleetProvider(settings, parse_hosts(settings.docker_hosts or ""))
    try:
        for gpu, plain in ((GpuClass.none, 0.25), (GpuClass.entry, 0.5)):
            spec = WorkerSpec(
                lease_id=str(uuid.uuid4()),
                kind=WorkerKind.renderer,
                gpu=gpu,
                expires_at=datetime.now(UTC),
            )
            place = fleet.placer(spec)
            first = place(set())  # the least loaded, ties in declared order: dear
            assert (first.host, first.price) == ("dear", 0.9)
            second = place({first.resource})
            assert (second.host, second.price) == ("plain", plain)
    finally:
        await fleet.close()


def test_a_worker_killed_on_one_host_ends_its_lease_at_once(
    make_fleet: MakeFleet, engines: dict[str, PrivateEngine]
) -> None:
    # Heard from gpu2's own event stream: no reconcile pass runs within the test.
    s = make_fleet("gpu1={gpu1}; gpu2={gpu2}", RECONCILE_INTERVAL_SECONDS="3600")
    on_gpu1, on_gpu2 = s.lease(kind="renderer"), s.lease(kind="renderer")
    assert hosts_of([on_gpu1, on_gpu2]) == ["gpu1", "gpu2"]
    gpu2 = engines["gpu2"]
    gpu2.client.containers.get(container_of(gpu2, s, on_gpu2)).kill()
    ended = lost(s, on_gpu2, "exited", 137)
    assert ended["provider_token"].startswith("gpu2/")
    wait_for(lambda: not on_engine(gpu2, s), 30, what="its remains removed from gpu2")
    assert state_of(s, on_gpu1) == "active" and on_engine(engines["gpu1"], s) == [
        on_gpu1["lease_id"]
    ]
