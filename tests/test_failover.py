"""Failover between providers, with two real local-docker providers in one service: the
first cannot make workers (its image does not exist), the second can."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from opentelemetry.trace import NoOpTracer

from openalice_scheduler.config import Settings
from openalice_scheduler.errors import ProvisionFailed
from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.lifecycle.policy import OrderedFirstAvailable
from openalice_scheduler.lifecycle.states import STATE_SETS
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.models import LeaseRequest, WorkerKind
from openalice_scheduler.providers.docker import LocalDockerProvider
from openalice_scheduler.store import open_store
from tests.harness import SECRET, WORKER_IMAGE, remove_instance


def docker_provider(name: str, instance: str, image: str) -> LocalDockerProvider:
    settings = Settings(  # type: ignore[call-arg]
        internal_secret=SECRET,
        scheduler_instance=instance,
        docker_network=f"oa-{instance}",
        renderer_image=image,
        anim_image=image,
        local_gpu_devices="",
    )
    provider = LocalDockerProvider(settings)
    provider.name = name
    return provider


@pytest.fixture
async def service(tmp_path: Path):  # type: ignore[no-untyped-def]
    instance = f"t-{uuid.uuid4().hex[:10]}"
    store = open_store(f"sqlite:///{tmp_path / 'failover.db'}", states=STATE_SETS)
    await store.migrate()
    broken = docker_provider("broken-docker", instance, "openalice-no-such-image:0")
    working = docker_provider("local-docker", instance, WORKER_IMAGE)
    svc = LeaseService(store, [broken, working], OrderedFirstAvailable(), Metrics(), NoOpTracer())
    yield svc
    await store.close()
    remove_instance(instance, f"oa-{instance}")


async def test_a_failed_provision_falls_over_to_the_next_provider(service: LeaseService) -> None:
    record = await service.acquire(LeaseRequest(kind=WorkerKind.renderer))
    assert record.provider == "local-docker" and record.state == "active"
    workers = await service.providers[1].list_workers()
    assert list(workers) == [record.lease_id]
    assert await service.providers[0].list_workers() == workers  # same engine, one worker
    failures = service.metrics.acquire_failures.labels("provision_failed")._value.get()
    assert failures == 0


async def test_when_every_provider_fails_the_error_lists_each(service: LeaseService) -> None:
    service.providers[1].images[WorkerKind.anim] = "openalice-no-such-image:1"
    with pytest.raises(ProvisionFailed) as caught:
        await service.acquire(LeaseRequest(kind=WorkerKind.anim))
    failures = caught.value.details["failures"]
    assert set(failures) == {"broken-docker", "local-docker"}
    assert "openalice-no-such-image:1" in failures["local-docker"]
    assert (await service.store.count_by_state()) == {"failed": 1}
    assert await service.providers[1].list_workers() == {}
