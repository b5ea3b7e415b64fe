"""The service's own image (issue 13): built by scripts/build-image.sh the way an operator
builds it, and run the way docs/operations/image.md#run-the-image runs it.

No registry answers here, so the base is made from Debian's packages (`--debian-base`:
mmdebstrap once, kept as openalice-base:bookworm) and the image is tagged
openalice-scheduler-test, leaving an operator's openalice-scheduler:latest alone. The
wheels are built on the host and cached in build/wheelhouse/, so a later run only builds
the project's own wheel and the last layers again.

The containers run as the image's non-root user with the host's Docker socket (its group
added: Docker makes the socket 660), on a user network that their workers join too, with
a named volume for SQLite, or as two replicas on PostgreSQL the way
deploy/compose.replicas.yml runs them. Everything a test makes (containers, workers,
network, volume, database, role) is removed at the end, also when it fails.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import docker
import httpx
import pytest

from openalice_scheduler.client.core import LIMITS
from tests import guardproc
from tests.harness import (
    INSTANCE_LABEL,
    PG_HOST,
    REPO,
    SECRET,
    TLS,
    WORKER_IMAGE,
    docker_client,
    fetch_in_network,
    free_port,
    list_containers,
    printed_in,
    remove_instance,
    wait_for,
)

# The first run on a fresh machine makes the Debian base and every wheel (minutes on
# a loaded 2-core host); later runs reuse both.
pytestmark = pytest.mark.timeout(900)

REPOSITORY = "openalice-scheduler-test"
SOCKET = "/var/run/docker.sock"
LEASE_LABEL = "openalice.scheduler.lease_id"
# On the test's own containers, which must not carry the instance label: the scheduler
# under test destroys containers with its instance label that it holds no lease for.
TEST_LABEL = "openalice.test"


@dataclass
class Image:
    name: str
    version: str


@pytest.fixture(scope="module")
def image() -> Image:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    built = subprocess.run(
        [str(REPO / "scripts" / "build-image.sh"), "--debian-base", "--repository", REPOSITORY],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, f"build-image.sh failed:\n{built.stdout}\n{built.stderr}"
    return Image(name=f"{REPOSITORY}:{version}", version=version)


def test_the_build_scripts_help_is_its_header_and_no_code() -> None:
    """`--help` prints the script's opening comment, all of it and nothing after (it printed
    a fixed range of lines, which had drifted to include two lines of the script)."""
    script = REPO / "scripts" / "build-image.sh"
    helped = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True)
    header = []
    for line in script.read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        header.append(line.removeprefix("#").removeprefix(" "))
    assert helped.stdout.splitlines() == header
    assert header[0].startswith("Build the service's image")
    assert header[-1].endswith("are compiled per version.")


def test_both_tags_are_built_and_the_image_prints_its_version(image: Image) -> None:
    client = docker_client()
    tagged = client.images.get(image.name)
    assert client.images.get(f"{REPOSITORY}:latest").id == tagged.id

    assert run_once(image, "--version") == f"openalice-scheduler {image.version}"

    config = tagged.attrs["Config"]
    assert config["Entrypoint"] == ["openalice-scheduler"] and config["Cmd"] == ["serve"]
    uid = run_once(image, "-c", "import os; print(os.getuid())", entrypoint="python3")
    assert int(uid) != 0, "the image runs as root"


def test_a_lease_survives_a_restart_and_a_new_container_on_the_volume(image: Image) -> None:
    with Deployment(image) as deployment:
        run = deployment.run(volume=True)
        assert run.docker_health() == "healthy"

        response = run.http.post(
            "/v1/lease", json={"kind": "renderer", "ttl_seconds": 600, "owner_id": "image-test"}
        )
        assert response.status_code == 200, f"{response.text}\n{run.logs()}"
        lease = response.json()["lease"]
        assert lease["state"] == "active"
        worker = deployment.worker(lease["lease_id"])
        assert worker is not None and worker.status == "running"
        # A caller on the scheduler's network reaches the worker at the lease's endpoint.
        assert lease["lease_id"] in fetch_in_network(deployment.network, lease["endpoint"])

        run.container.restart(timeout=45)
        run.wait_serving()

        after = run.http.get(f"/v1/lease/{lease['lease_id']}")
        assert after.status_code == 200, f"{after.text}\n{run.logs()}"
        assert after.json()["state"] == "active"
        assert after.json()["endpoint"] == lease["endpoint"]
        kept = deployment.worker(lease["lease_id"])
        assert kept is not None and kept.id == worker.id and kept.status == "running"

        # A restart keeps the container's own files too; a new container (a new version,
        # say) has only the volume. `docker stop` first: the service, PID 1, shuts down
        # on SIGTERM (exit 0) rather than being killed when the wait runs out (137).
        run.container.stop(timeout=45)
        run.container.reload()
        assert run.container.attrs["State"]["ExitCode"] == 0, run.logs()
        run.container.remove()
        run = deployment.run(volume=True)
        again = run.http.get(f"/v1/lease/{lease['lease_id']}")
        assert again.status_code == 200 and again.json()["state"] == "active", again.text
        assert deployment.worker(lease["lease_id"]).id == worker.id

        released = run.http.delete(
            f"/v1/lease/{lease['lease_id']}", headers={"X-Lease-Owner": "image-test"}
        )
        assert released.status_code == 204, f"{released.text}\n{run.logs()}"
        wait_for(
            lambda: deployment.worker(lease["lease_id"]) is None,
            timeout=30,
            what="the worker removed on release",
        )


def test_a_guard_from_the_image_destroys_a_dead_schedulers_expired_worker(image: Image) -> None:
    """docs/concepts/guard.md#the-guard: a guard container of the image beside the scheduler's, run
    as the docs run it (`--restart=always`, the socket's group). The scheduler container is
    killed; the guard destroys the worker of its expired lease and leaves the long lease's worker
    running."""
    with Deployment(image) as deployment:
        run = deployment.run()
        guard = deployment.client.containers.run(
            image.name,
            ["guard"],
            detach=True,
            labels={TEST_LABEL: "image"},
            name=f"oa-img-{deployment.instance}-guard",
            network=deployment.network,
            restart_policy={"Name": "always"},
            group_add=[str(os.stat(SOCKET).st_gid)],
            volumes={SOCKET: {"bind": SOCKET, "mode": "rw"}},
            environment={
                "INTERNAL_SECRET": SECRET,
                "SCHEDULER_INSTANCE": deployment.instance,
                "LOCAL_GPU_DEVICES": "",
                "GUARD_ID": "guard-image",
                "GUARD_SCHEDULER_URL": f"http://{run.container.name}:8080",
                "GUARD_STATE_FILE": "/data/guard.json",
                **guardproc.FAST,
            },
        )
        try:

            def guard_contacts() -> list[Any]:
                views = run.http.get("/v1/providers").json()
                return [g for v in views for g in v["guards"] if g["guard_id"] == "guard-image"]

            wait_for(
                guard_contacts,
                timeout=60,
                what=f"the guard's first poll:\n{guard.logs().decode(errors='replace')}",
            )
            short = run.http.post("/v1/lease", json={"kind": "renderer", "ttl_seconds": 5})
            long = run.http.post("/v1/lease", json={"kind": "renderer", "ttl_seconds": 600})
            assert short.status_code == 200 and long.status_code == 200, short.text + long.text
            short_id, long_id = short.json()["lease"]["lease_id"], long.json()["lease"]["lease_id"]
            polled = guard_contacts()[0]["last_contact"]
            wait_for(
                lambda: guard_contacts()[0]["last_contact"] > polled,
                timeout=30,
                what="a poll of the guard after both leases",
            )
            run.container.kill()
            wait_for(
                lambda: deployment.worker(short_id) is None,
                timeout=60,
                what=f"the guard destroying the expired lease's worker:\n"
                f"{guard.logs().decode(errors='replace')}",
            )
            kept = deployment.worker(long_id)
            assert kept is not None and kept.status == "running"
            guard.reload()
            assert guard.status == "running"
            assert SECRET not in guard.logs().decode(errors="replace")
        finally:
            guard.remove(force=True, v=True)


def test_two_replicas_of_the_image_share_leases_on_postgresql(image: Image) -> None:
    """deploy/compose.replicas.yml's shape: two containers of the image, one database.
    On the host's network here, to reach the host's PostgreSQL on loopback."""
    with Deployment(image) as deployment, postgres_database() as url:
        a, b = (deployment.run(host_network=True, DATABASE_URL=url) for _ in range(2))

        lease = a.http.post("/v1/lease", json={"kind": "renderer", "ttl_seconds": 600})
        assert lease.status_code == 200, f"{lease.text}\n{a.logs()}"
        lease_id = lease.json()["lease"]["lease_id"]
        seen = b.http.get(f"/v1/lease/{lease_id}")
        assert seen.status_code == 200 and seen.json()["state"] == "active", seen.text
        assert deployment.worker(lease_id) is not None

        assert b.http.delete(f"/v1/lease/{lease_id}").status_code == 204
        wait_for(
            lambda: deployment.worker(lease_id) is None,
            timeout=30,
            what="the worker removed on release",
        )
        assert a.http.get(f"/v1/lease/{lease_id}").json()["state"] == "released"


def test_without_the_sockets_group_the_image_cannot_drive_docker(image: Image) -> None:
    """The image's user is not root: the socket's group is what lets it in
    (docs/operations/image.md#what-the-image-does-and-what-it-needs-from-you)."""
    with Deployment(image) as deployment:
        run = deployment.run(group_add=False)
        providers = run.http.get("/v1/providers")
        assert providers.status_code == 200, providers.text
        (docker_view,) = providers.json()
        assert not docker_view["healthy"] and SOCKET in docker_view["detail"]
        refused = run.http.post("/v1/lease", json={"kind": "renderer", "ttl_seconds": 60})
        assert refused.status_code == 503, refused.text
        assert deployment.workers() == []


def test_the_image_serves_under_the_kubernetes_deployment_s_security_context(
    image: Image,
) -> None:
    """deploy/kubernetes/deployment.yaml as Docker would run it: the pod's user, group
    and fsGroup, a read-only root file system, every capability dropped, no privilege
    escalation, its emptyDir and volume mounts and its environment (its INTERNAL_SECRET
    given, PROVIDERS=local-docker without a socket since no cluster is here). Its probes'
    paths answer 200 on its port, the database is on the volume, and SIGTERM ends it with
    0 within the pod's grace period (docs/operations/kubernetes-deploy.md)."""
    from tests.test_k8s_deploy import container, pod_spec, resolved_env

    spec, main = pod_spec(), container()
    pod, own = spec["securityContext"], main["securityContext"]
    assert own["readOnlyRootFilesystem"] and own["capabilities"]["drop"] == ["ALL"]
    assert own["allowPrivilegeEscalation"] is False
    volumes = {v["name"]: v for v in spec["volumes"]}
    name = f"oa-img-k8s-{uuid.uuid4().hex[:8]}"
    mounts = {m["mountPath"]: volumes[m["name"]] for m in main["volumeMounts"]}
    [data] = [path for path, v in mounts.items() if "persistentVolumeClaim" in v]
    client = docker_client()
    run = client.containers.run(
        image.name,
        main["args"],
        detach=True,
        name=name,
        labels={TEST_LABEL: "image"},
        user=f"{pod['runAsUser']}:{pod['runAsGroup']}",
        group_add=[str(pod["fsGroup"])],
        read_only=True,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        tmpfs={path: "" for path, v in mounts.items() if "emptyDir" in v},
        volumes={name: {"bind": data, "mode": "rw"}},
        environment={**resolved_env(), "INTERNAL_SECRET": SECRET, "PROVIDERS": "local-docker"},
    )
    try:
        run.reload()
        address = next(iter(run.attrs["NetworkSettings"]["Networks"].values()))["IPAddress"]
        port = main["ports"][0]["containerPort"]

        def answers(path: str) -> bool:
            with suppress(httpx.HTTPError):
                return httpx.get(f"http://{address}:{port}{path}", timeout=5).status_code == 200
            return False

        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            path = main[probe]["httpGet"]["path"]
            wait_for(lambda path=path: answers(path), timeout=120, what=f"{probe} {path}")
        listing = printed_in(run, ["python3", "-c", f"import os; print(os.listdir({data!r}))"])
        assert b"openalice-scheduler.db" in listing, listing
        run.stop(timeout=spec["terminationGracePeriodSeconds"])
        run.reload()
        assert run.attrs["State"]["ExitCode"] == 0, run.logs().decode(errors="replace")
        assert SECRET not in run.logs().decode(errors="replace")
    finally:
        run.remove(force=True, v=True)
        with suppress(docker.errors.NotFound):
            client.volumes.get(name).remove(force=True)


def run_once(image: Image, *command: str, entrypoint: str | None = None) -> str:
    """What a one-off `docker run --rm IMAGE command` prints. Removed with its anonymous
    /data volume, as the CLI's --rm does (the SDK's remove keeps volumes)."""
    container = docker_client().containers.create(
        image.name, list(command), entrypoint=entrypoint, labels={TEST_LABEL: "image"}
    )
    try:
        container.start()
        status = container.wait(timeout=60)
        out = container.logs().decode(errors="replace")
        assert status["StatusCode"] == 0, f"{command} exited {status['StatusCode']}:\n{out}"
        return str(out.strip())
    finally:
        container.remove(force=True, v=True)


@dataclass
class Replica:
    """One scheduler container, called over HTTP from the host."""

    container: Any
    host_network: bool
    port: int = 8080
    http: httpx.Client = field(
        default_factory=lambda: httpx.Client(
            verify=TLS, timeout=60, headers={"X-Internal-Secret": SECRET}, limits=LIMITS
        )
    )

    def wait_serving(self) -> None:
        """Until /health answers (on the published port, read again: a restart may
        publish another one)."""

        def serving() -> bool:
            self.container.reload()
            if self.container.status == "exited":
                raise AssertionError(f"the scheduler container exited:\n{self.logs()}")
            port = self.port if self.host_network else self._published_port()
            if port is None:
                return False
            self.http.base_url = f"http://127.0.0.1:{port}"
            try:
                return self.http.get("/health", timeout=2).is_success
            except httpx.HTTPError:
                return False

        try:
            wait_for(serving, timeout=90, interval=0.2, what="the container's /health")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def docker_health(self) -> str:
        """The engine's own verdict from the image's HEALTHCHECK, once it has one."""

        def verdict() -> str | None:
            self.container.reload()
            status = self.container.attrs["State"].get("Health", {}).get("Status")
            return None if status in (None, "starting") else status

        return str(wait_for(verdict, timeout=60, interval=0.5, what="a health verdict"))

    def logs(self) -> str:
        with suppress(docker.errors.APIError):
            return str(self.container.logs().decode(errors="replace"))
        return ""

    def _published_port(self) -> int | None:
        ports = self.container.attrs["NetworkSettings"]["Ports"].get("8080/tcp") or []
        return int(ports[0]["HostPort"]) if ports else None


class Deployment:
    """Scheduler containers of the image as docs/operations/image.md runs them, sharing a
    network, an instance and (with SQLite) a volume of their own; all removed on exit."""

    def __init__(self, image: Image) -> None:
        suffix = uuid.uuid4().hex[:10]
        self.image = image
        self.client = docker_client()
        self.instance = f"t-{suffix}"
        self.network = f"oa-img-{suffix}"
        self.volume = f"oa-img-{suffix}"
        self.replicas: list[Replica] = []

    def __enter__(self) -> Deployment:
        self.client.networks.create(self.network, driver="bridge", labels={TEST_LABEL: "image"})
        self.client.volumes.create(self.volume, labels={TEST_LABEL: "image"})
        return self

    def __exit__(self, *exc: object) -> None:
        for replica in self.replicas:
            replica.http.close()
            with suppress(docker.errors.NotFound):
                replica.container.remove(force=True, v=True)
        remove_instance(self.instance, self.network)
        with suppress(docker.errors.NotFound):
            self.client.volumes.get(self.volume).remove(force=True)

    def run(
        self, volume: bool = False, group_add: bool = True, host_network: bool = False, **env: str
    ) -> Replica:
        """Start one scheduler container and wait until it serves. `volume`: the
        deployment's volume on /data; `host_network`: on the host's network, on a port of
        its own, instead of the deployment's network with a published port."""
        port = free_port() if host_network else 8080
        if host_network:
            env.setdefault("SCHEDULER_HOST", "127.0.0.1")  # not on the host's every address
        volumes = {SOCKET: {"bind": SOCKET, "mode": "rw"}}
        if volume:
            volumes[self.volume] = {"bind": "/data", "mode": "rw"}
        network: dict[str, Any] = (
            {"network_mode": "host"}
            if host_network
            else {"network": self.network, "ports": {"8080/tcp": ("127.0.0.1", None)}}
        )
        container = self.client.containers.run(
            self.image.name,
            detach=True,
            labels={TEST_LABEL: "image"},
            name=f"oa-img-{self.instance}-{len(self.replicas)}",
            # The socket is root:docker (or root:root) on the host; the image's user gets
            # its group, as docs/operations/image.md tells operators.
            group_add=[str(os.stat(SOCKET).st_gid)] if group_add else None,
            volumes=volumes,
            environment={
                "INTERNAL_SECRET": SECRET,
                "SCHEDULER_INSTANCE": self.instance,
                "SCHEDULER_PORT": str(port),
                "DOCKER_NETWORK": self.network,
                "RENDERER_IMAGE": WORKER_IMAGE,
                "LOCAL_GPU_DEVICES": "",
                **env,
            },
            **network,
        )
        replica = Replica(container=container, host_network=host_network, port=port)
        self.replicas.append(replica)
        replica.wait_serving()
        return replica

    def workers(self) -> list[Any]:
        return list_containers(
            self.client, all=True, filters={"label": f"{INSTANCE_LABEL}={self.instance}"}
        )

    def worker(self, lease_id: str) -> Any:
        found = list_containers(
            self.client,
            all=True,
            filters={"label": [f"{LEASE_LABEL}={lease_id}", f"{INSTANCE_LABEL}={self.instance}"]},
        )
        return found[0] if found else None


@contextmanager
def postgres_database() -> Iterator[str]:
    """A fresh database on the host's PostgreSQL, owned by a role with a password (the
    container's user has no account on the host for peer authentication)."""
    name = f"oa_img_{uuid.uuid4().hex[:12]}"
    password = secrets.token_urlsafe(16)

    def psql(sql: str) -> None:
        subprocess.run(
            ["psql", "-h", PG_HOST, "-d", "postgres", "-qc", sql], check=True, capture_output=True
        )

    psql(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
    try:
        psql(f"CREATE DATABASE {name} OWNER {name}")
        # Over TCP: a unix socket directory is the host's, loopback is shared with
        # containers on the host's network.
        host = "127.0.0.1" if PG_HOST.startswith("/") else PG_HOST
        yield f"postgresql://{name}:{password}@{host}:{os.environ.get('PGPORT', '5432')}/{name}"
    finally:
        with suppress(subprocess.CalledProcessError):
            psql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        with suppress(subprocess.CalledProcessError):
            psql(f"DROP ROLE IF EXISTS {name}")
