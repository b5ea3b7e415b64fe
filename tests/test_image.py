"""The service's own image (issue 13): built by scripts/build-image.sh the way an operator
builds it, and run the way the README runs it.

No registry answers here, so the base is made from Debian's packages (`--debian-base`:
debootstrap once, kept as openalice-base:bookworm) and the image is tagged
openalice-scheduler-test, leaving an operator's openalice-scheduler:latest alone. The
wheels are built on the host and cached in build/wheelhouse/, so a later run only builds
the project's own wheel and the last layers again.

The container runs as the image's non-root user with the host's Docker socket (its group
added), a named volume for the SQLite database, and a user network that its workers join
too. Everything a test makes (containers, workers, network, volume) is removed at the
end, also when it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import uuid
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import docker
import httpx
import pytest

from tests.harness import (
    INSTANCE_LABEL,
    REPO,
    SECRET,
    WORKER_IMAGE,
    docker_client,
    fetch_in_network,
    list_containers,
    remove_instance,
    wait_for,
)

# The first run on a fresh machine makes the Debian base and every wheel (minutes on
# a loaded 2-core host); later runs reuse both.
pytestmark = pytest.mark.timeout(900)

REPOSITORY = "openalice-scheduler-test"
SOCKET = "/var/run/docker.sock"
LEASE_LABEL = "openalice.scheduler.lease_id"
# Labels the test's own containers, so they are never mistaken for workers (the
# scheduler under test destroys containers labelled with its instance that it has no
# lease for).
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
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
    )
    assert built.returncode == 0, f"build-image.sh failed:\n{built.stdout}\n{built.stderr}"
    return Image(name=f"{REPOSITORY}:{version}", version=version)


def test_both_tags_are_built_and_the_image_prints_its_version(image: Image) -> None:
    client = docker_client()
    tagged = client.images.get(image.name)
    assert client.images.get(f"{REPOSITORY}:latest").id == tagged.id

    assert run_once(image, "--version") == f"openalice-scheduler {image.version}"

    config = tagged.attrs["Config"]
    assert config["Entrypoint"] == ["openalice-scheduler"] and config["Cmd"] == ["serve"]
    uid = run_once(image, "-c", "import os; print(os.getuid())", entrypoint="python3")
    assert int(uid) != 0, "the image runs as root"


def test_a_lease_made_through_the_image_survives_a_restart(image: Image) -> None:
    with ImageRun(image) as run:
        run.start()
        assert run.docker_health() == "healthy"

        response = run.http.post("/v1/lease", json={
            "kind": "renderer", "ttl_seconds": 600, "owner_id": "image-test"})
        assert response.status_code == 200, f"{response.text}\n{run.logs()}"
        lease = response.json()["lease"]
        assert lease["state"] == "active"
        worker = run.worker(lease["lease_id"])
        assert worker is not None and worker.status == "running"
        # A caller on the scheduler's network reaches the worker at the lease's endpoint.
        answer = fetch_in_network(run.network, lease["endpoint"])
        assert lease["lease_id"] in answer

        run.container.restart(timeout=45)
        run.wait_serving()

        after = run.http.get(f"/v1/lease/{lease['lease_id']}")
        assert after.status_code == 200, f"{after.text}\n{run.logs()}"
        assert after.json()["state"] == "active"
        assert after.json()["endpoint"] == lease["endpoint"]
        restarted_worker = run.worker(lease["lease_id"])
        assert restarted_worker is not None and restarted_worker.id == worker.id

        released = run.http.delete(f"/v1/lease/{lease['lease_id']}",
                                     headers={"X-Lease-Owner": "image-test"})
        assert released.status_code == 204, f"{released.text}\n{run.logs()}"
        wait_for(lambda: run.worker(lease["lease_id"]) is None, timeout=30,
                 what="the worker removed on release")


def run_once(image: Image, *command: str, entrypoint: str | None = None) -> str:
    """What a one-off `docker run --rm IMAGE command` prints. Removed with its anonymous
    /data volume, as the CLI's --rm does (the SDK's remove keeps volumes)."""
    container = docker_client().containers.create(
        image.name, list(command), entrypoint=entrypoint, labels={TEST_LABEL: "image"})
    try:
        container.start()
        status = container.wait(timeout=60)
        out = container.logs().decode(errors="replace")
        assert status["StatusCode"] == 0, f"{command} exited {status['StatusCode']}:\n{out}"
        return str(out.strip())
    finally:
        container.remove(force=True, v=True)


def test_without_the_sockets_group_the_image_cannot_drive_docker(image: Image) -> None:
    """The image's user is not root: the socket's group is what lets it in (README)."""
    with ImageRun(image) as run:
        run.start(group_add=False)
        providers = run.http.get("/v1/providers")
        assert providers.status_code == 200, providers.text
        (docker_view,) = providers.json()
        assert not docker_view["healthy"] and SOCKET in docker_view["detail"]
        refused = run.http.post("/v1/lease", json={"kind": "renderer", "ttl_seconds": 60})
        assert refused.status_code == 503, refused.text
        assert run.client.containers.list(
            all=True, filters={"label": f"{INSTANCE_LABEL}={run.instance}"}) == []


class ImageRun:
    """One scheduler container from the image, as the README runs it, with a network,
    a volume and an instance of its own; all removed on exit."""

    def __init__(self, image: Image) -> None:
        suffix = uuid.uuid4().hex[:10]
        self.image = image
        self.client = docker_client()
        self.instance = f"t-{suffix}"
        self.network = f"oa-img-{suffix}"
        self.volume = f"oa-img-{suffix}"
        self.container: Any = None
        self.http = httpx.Client(timeout=60, headers={"X-Internal-Secret": SECRET})

    def __enter__(self) -> ImageRun:
        self.client.networks.create(self.network, driver="bridge", labels={TEST_LABEL: "image"})
        self.client.volumes.create(self.volume, labels={TEST_LABEL: "image"})
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.close()
        if self.container is not None:
            with suppress(docker.errors.NotFound):
                self.container.remove(force=True)
        remove_instance(self.instance, self.network)
        with suppress(docker.errors.NotFound):
            self.client.volumes.get(self.volume).remove(force=True)

    def start(self, group_add: bool = True) -> None:
        self.container = self.client.containers.run(
            self.image.name, detach=True, name=f"oa-img-{self.instance}",
            labels={TEST_LABEL: "image"},
            network=self.network,
            # The socket is root:docker (or root:root) on the host; the image's user gets
            # its group, as README tells operators.
            group_add=[str(os.stat(SOCKET).st_gid)] if group_add else None,
            volumes={SOCKET: {"bind": SOCKET, "mode": "rw"},
                     self.volume: {"bind": "/data", "mode": "rw"}},
            ports={"8080/tcp": ("127.0.0.1", None)},
            environment={
                "INTERNAL_SECRET": SECRET,
                "SCHEDULER_INSTANCE": self.instance,
                "DOCKER_NETWORK": self.network,
                "RENDERER_IMAGE": WORKER_IMAGE,
                "LOCAL_GPU_DEVICES": "",
            },
        )
        self.wait_serving()

    def wait_serving(self) -> None:
        """Until /health answers on the published port (read again: a restart may
        publish another one)."""

        def serving() -> bool:
            self.container.reload()
            if self.container.status == "exited":
                raise AssertionError(f"the scheduler container exited:\n{self.logs()}")
            ports = self.container.attrs["NetworkSettings"]["Ports"].get("8080/tcp") or []
            if not ports:
                return False
            self.http.base_url = f"http://127.0.0.1:{ports[0]['HostPort']}"
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

    def worker(self, lease_id: str) -> Any:
        found = list_containers(self.client, all=True, filters={
            "label": [f"{LEASE_LABEL}={lease_id}", f"{INSTANCE_LABEL}={self.instance}"]})
        return found[0] if found else None

    def logs(self) -> str:
        if self.container is None:
            return ""
        with suppress(docker.errors.APIError):
            return str(self.container.logs().decode(errors="replace"))
        return ""

