"""local-docker: workers as containers on Docker engines. One engine (DOCKER_HOST,
`LocalDockerProvider`), or a fleet of them (DOCKER_HOSTS, `DockerFleetProvider`)."""

from openalice_scheduler.providers.docker.engine import (
    LABEL_INSTANCE,
    LABEL_LEASE,
    DockerEngine,
    container_name,
)
from openalice_scheduler.providers.docker.fleet import DockerFleetProvider
from openalice_scheduler.providers.docker.provider import LocalDockerProvider

__all__ = [
    "LABEL_INSTANCE",
    "LABEL_LEASE",
    "DockerEngine",
    "DockerFleetProvider",
    "LocalDockerProvider",
    "container_name",
]
