"""The RunPod provider, in process, against the emulator over real HTTP, on both
transports: what a lease becomes on RunPod (template or image, GPU candidates from the
catalog, region, CPU pods, name, env, endpoint), how each row of the error table moves the
provider, release, and reconciliation through a real LeaseService and store."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.trace import NoOpTracer

from openalice_scheduler.config import Settings
from openalice_scheduler.errors import (
    NoProviderAvailable,
    ProviderError,
    ProviderOutOfCapacity,
    ProvisionFailed,
    ReleaseFailed,
)
from openalice_scheduler.lifecycle import SYSTEM_CLOCK, LeaseService
from openalice_scheduler.lifecycle.policy import OrderedFirstAvailable
from openalice_scheduler.lifecycle.states import STATE_SETS
from openalice_scheduler.loops import Alarm, Reconciler, Sweeper
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.models import GpuClass, LeaseRequest, WorkerKind
from openalice_scheduler.providers.base import WorkerSpec
from openalice_scheduler.providers.runpod import RunPodProvider
from openalice_scheduler.providers.runpod.client import Pod, PodRequest
from openalice_scheduler.store import LeaseStore, open_store
from tests.harness import SECRET, wait_for
from tests.runpod_emulator import NO_CAPACITY_MESSAGE, RunPodEmulator
from tests.runpod_emulator.state import Pod as EmulatedPod
from tests.runpod_setup import make_client

KEY = "rpk-provider-" + uuid.uuid4().hex
MID = ["NVIDIA L40S", "NVIDIA RTX 6000 Ada Generation", "NVIDIA RTX A6000"]
L40S, ADA, A6000 = MID
ENTRY = ["NVIDIA GeForce RTX 4090", "NVIDIA RTX A5000", "NVIDIA GeForce RTX 3090"]


def settings(runpod: RunPodEmulator, api: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "internal_secret": SECRET,
        "scheduler_instance": f"t-{uuid.uuid4().hex[:10]}",
        "runpod_api_key": KEY,
        "runpod_api": api,
        "runpod_api_base_url": runpod.base_url,
        "runpod_poll_interval_seconds": 0.05,
        "runpod_catalog_ttl_seconds": 0,
        "runpod_request_timeout_seconds": 5,
        "local_gpu_devices": "",
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture
async def make_provider(
    runpod: RunPodEmulator,
) -> AsyncIterator[Callable[..., RunPodProvider]]:
    made: list[RunPodProvider] = []

    def make(
        api: str, *, key: str = KEY, backoff: float = 0.05, **overrides: Any
    ) -> RunPodProvider:
        config = settings(runpod, api, runpod_api_key=key, **overrides)
        timeout = config.runpod_request_timeout_seconds
        client = make_client(api, runpod.base_url, key, timeout=timeout, backoff=backoff)
        provider = RunPodProvider(config, client=client)
        made.append(provider)
        return provider

    yield make
    for provider in made:
        await provider.close()


@pytest.fixture
def provider(api: str, make_provider: Callable[..., RunPodProvider]) -> RunPodProvider:
    return make_provider(api)


def spec(
    gpu: GpuClass = GpuClass.mid, kind: WorkerKind = WorkerKind.renderer, **details: Any
) -> WorkerSpec:
    """The worker of a new lease of an hour; `details` (region, env) as WorkerSpec takes
    them."""
    an_hour = datetime.now(UTC) + timedelta(hours=1)
    return WorkerSpec(lease_id=str(uuid.uuid4()), kind=kind, gpu=gpu, expires_at=an_hour, **details)


async def make_pod(provider: RunPodProvider, name: str) -> Pod:
    """A pod named `name`, made behind the provider's back with its own client."""
    return await provider.client.create_pod(
        PodRequest(name=name, env={}, ports=["8080/http"], image="x", gpu_type_id=L40S)
    )


async def until(predicate: Callable[[], Any], what: str, timeout: float = 10) -> Any:
    """The shared poll (`wait_for`) of the emulator's state, run off the loop, where the
    provider under test goes on meanwhile."""
    return await asyncio.to_thread(wait_for, predicate, timeout, what=what)


async def left_starting(
    runpod: RunPodEmulator, provision: Awaitable[Any]
) -> tuple[asyncio.Future[Any], EmulatedPod]:
    """`provision` begun in a task, once its pod is created: the task, and the pod, which
    stays starting (not RUNNING for 30 s) while the test does something to it."""
    runpod.provision_delay = 30
    task = asyncio.ensure_future(provision)
    await until(runpod.list_pods, "the pod to be created")
    [pod] = runpod.list_pods()
    return task, pod


def polling(
    make_provider: Callable[..., RunPodProvider],
    runpod: RunPodEmulator,
    api: str,
    every: float,
    pods_run_after: float,
) -> RunPodProvider:
    """A provider that looks at its starting pods `every` so many seconds, and pods that run
    `pods_run_after` seconds after their create: the pace that the test is about."""
    runpod.provision_delay = pods_run_after
    return make_provider(api, runpod_poll_interval_seconds=every)


def create_bodies(runpod: RunPodEmulator) -> list[dict[str, Any]]:
    """What each create asked for, in API-neutral words."""
    out = []
    for call in runpod.calls("create"):
        body = call.body or {}
        if call.api == "graphql":
            value = body["variables"]["input"]
            out.append(
                {
                    "name": value.get("name"),
                    "gpu": value.get("gpuTypeId"),
                    "dc": [value["dataCenterId"]] if value.get("dataCenterId") else [],
                    "status": call.status,
                }
            )
        else:
            out.append(
                {
                    "name": body.get("name"),
                    "gpu": (body.get("gpu") or {}).get("id"),
                    "cpu": body.get("cpu"),
                    "dc": body.get("dataCenterIds", []),
                    "status": call.status,
                }
            )
    return out


def tried(runpod: RunPodEmulator) -> list[str | None]:
    return [body["gpu"] for body in create_bodies(runpod)]


# --- what a lease becomes ---------------------------------------------------------------


async def test_pod_name_env_image_and_endpoint(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    worker_spec = spec(env={"SCENE": "intro", "LEASE_ID": "forged"})
    worker = await provider.provision(worker_spec)
    [pod] = runpod.list_pods()
    assert pod.name == f"oa-{provider.instance}-{worker_spec.lease_id}"
    assert worker.provider_token == pod.id
    assert worker.endpoint == f"https://{pod.id}-8080.proxy.runpod.net"
    assert pod.status == "RUNNING"  # returned only once usable
    assert pod.image == "openalice-demo-worker:latest" and pod.ports == ("8080/http",)
    assert pod.env == {
        "SCENE": "intro",
        "LEASE_ID": worker_spec.lease_id,  # the markers win over a caller's env
        "LEASE_EXPIRES_AT": worker_spec.expires_at.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "WORKER_KIND": "renderer",
        "OPENALICE_SCHEDULER_INSTANCE": provider.instance,
    }
    assert pod.gpu_id in MID and pod.gpu_count == 1


async def test_kind_maps_to_a_template_or_an_image(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider(
        api, runpod_anim_template="tpl-anim-7", anim_port=9000, renderer_image="example/renderer:3"
    )
    anim = await provider.provision(spec(kind=WorkerKind.anim))
    renderer = await provider.provision(spec(kind=WorkerKind.renderer))
    pods = {pod.id: pod for pod in runpod.list_pods()}
    assert pods[anim.provider_token].image == "runpod-template/tpl-anim-7"
    assert pods[anim.provider_token].ports == ("9000/http",)
    assert pods[anim.provider_token].env["WORKER_KIND"] == "anim"
    assert anim.endpoint == f"https://{anim.provider_token}-9000.proxy.runpod.net"
    assert pods[renderer.provider_token].image == "example/renderer:3"
    first = runpod.calls("create")[0].body
    if api == "rest":
        assert first["templateId"] == "tpl-anim-7" and "image" not in first
    else:
        value = first["variables"]["input"]
        assert value["templateId"] == "tpl-anim-7" and "imageName" not in value


async def test_graphql_takes_the_classes_candidates_in_configured_order(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("graphql")
    await provider.provision(spec(GpuClass.mid))
    await provider.provision(spec(GpuClass.high))
    await provider.provision(spec(GpuClass.entry))
    assert tried(runpod) == [L40S, "NVIDIA H100 80GB HBM3", ENTRY[0]]


async def test_rest_orders_candidates_by_price_and_skips_no_stock(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("rest")
    runpod.set_price(L40S, secure=0.50)
    runpod.set_price(ADA, secure=0.40)
    runpod.set_price(A6000, secure=0.30)
    runpod.set_stock(A6000, "NONE")  # cheapest, but none to rent
    candidates = (await provider._candidates(spec())).candidates
    assert [c.gpu_type_id for c in candidates] == [ADA, L40S]
    await provider.provision(spec())
    assert tried(runpod) == [ADA]  # never asked for the one with NONE

    runpod.set_capacity(ADA, 0)  # the catalog now shows NONE for it as well
    await provider.provision(spec())
    assert tried(runpod) == [ADA, L40S]


async def test_rest_price_ties_go_to_more_stock_then_configured_order(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("rest")
    for gpu in MID:
        runpod.set_price(gpu, secure=0.7)
    runpod.set_stock(L40S, "LOW")
    runpod.set_stock(ADA, "MEDIUM")
    runpod.set_stock(A6000, "MEDIUM")
    candidates = (await provider._candidates(spec())).candidates
    assert [c.gpu_type_id for c in candidates] == [ADA, A6000, L40S]


async def test_community_cloud_uses_community_prices(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("rest", runpod_cloud="COMMUNITY")
    runpod.set_price(L40S, secure=9.0, community=0.1)
    runpod.set_price(A6000, secure=0.1, community=9.0)
    await provider.provision(spec())
    assert tried(runpod) == [L40S]
    assert runpod.calls("create")[0].body["cloud"] == "COMMUNITY"


async def test_region_filters_data_centers_on_rest(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("rest")
    runpod.set_data_center_stock("EU-RO-1", "NONE", gpu_id=A6000)
    worker = await provider.provision(spec(region="EU"))
    [body] = create_bodies(runpod)
    assert body["gpu"] == A6000 and body["dc"] == ["EU-SE-1"]
    [pod] = runpod.list_pods()
    assert pod.id == worker.provider_token and pod.data_center_id == "EU-SE-1"

    # A whole data center id is a region too; no stock there for the cheapest: next one.
    await provider.provision(spec(region="EU-RO-1"))
    assert create_bodies(runpod)[1]["dc"] == ["EU-RO-1"]
    assert create_bodies(runpod)[1]["gpu"] != A6000


async def test_a_region_that_cannot_be_placed_is_not_available(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("rest")
    for gpu_class in (GpuClass.mid, GpuClass.none):
        availability = await provider.available(spec(gpu_class, region="AP"))
        assert not availability.ok and "AP" in availability.reason
    # In a region where the class has no stock (though others have): not available either.
    for gpu in MID:
        runpod.set_data_center_stock("US-CA-2", "NONE", gpu_id=gpu)
    availability = await provider.available(spec(region="US-CA-2"))
    assert not availability.ok and "US-CA-2" in availability.reason
    assert (await provider.available(spec(region="US"))).ok
    assert runpod.call_count("create") == 0


async def test_graphql_places_in_the_data_center_named_by_region(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("graphql")
    await provider.provision(spec(region="EU-SE-1"))
    [body] = create_bodies(runpod)
    assert body["dc"] == ["EU-SE-1"]
    [pod] = runpod.list_pods()
    assert pod.data_center_id == "EU-SE-1"


async def test_gpu_none_is_a_cpu_pod_on_rest(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("rest", runpod_cpu_flavor="cpu3c")
    assert (await provider.available(spec(GpuClass.none))).ok
    worker = await provider.provision(spec(GpuClass.none, kind=WorkerKind.anim))
    body = runpod.calls("create")[0].body
    assert body["cpu"] == {"id": "cpu3c", "vcpuCount": 2} and "gpu" not in body
    [pod] = runpod.list_pods()
    assert pod.cpu_id == "cpu3c" and pod.gpu_id is None and pod.id == worker.provider_token
    assert runpod.call_count("catalog") == 0  # no region: nothing to look up

    await provider.provision(spec(GpuClass.none, region="US-KS"))
    assert runpod.calls("create")[1].body["dataCenterIds"] == ["US-KS-2"]


async def test_gpu_none_is_refused_on_graphql(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("graphql")
    availability = await provider.available(spec(GpuClass.none))
    assert not availability.ok and "REST" in availability.reason
    with pytest.raises(ProviderError):
        await provider.provision(spec(GpuClass.none))
    assert runpod.calls() == []


# --- available() ------------------------------------------------------------------------


async def test_not_available_when_no_candidate_has_stock(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("rest")
    for gpu in MID:
        runpod.set_no_capacity(gpu)
    availability = await provider.available(spec(GpuClass.mid))
    assert not availability.ok
    assert "no stock" in availability.reason and all(g in availability.reason for g in MID)
    assert (await provider.available(spec(GpuClass.entry))).ok
    runpod.set_no_capacity(ADA, False)
    assert (await provider.available(spec(GpuClass.mid))).ok  # TTL 0: seen at once


async def test_not_available_when_no_type_is_configured(
    make_provider: Callable[..., RunPodProvider],
) -> None:
    provider = make_provider("rest", runpod_gpu_high="")
    availability = await provider.available(spec(GpuClass.high))
    assert not availability.ok and "gpu=high" in availability.reason


async def test_catalog_is_cached_and_shared(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("rest", runpod_catalog_ttl_seconds=30)
    runpod.set_delay(0.2, op="catalog")
    results = await asyncio.gather(*(provider.available(spec()) for _ in range(20)))
    assert all(r.ok for r in results)
    await provider.provision(spec())
    assert runpod.call_count("catalog") == 1

    fresh = make_provider("rest", runpod_catalog_ttl_seconds=0)
    results = await asyncio.gather(*(fresh.available(spec()) for _ in range(20)))
    assert all(r.ok for r in results)
    assert runpod.call_count("catalog") == 2  # one fetch in flight serves every caller


# --- the error table, as the provider acts on it ------------------------------------------


@pytest.mark.parametrize("status", [422, 402])
async def test_422_or_402_fails_without_retry_or_other_candidates(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator, status: int
) -> None:
    """A contract break (422) or a balance too low (402) would be the same on every
    candidate: the provision fails at once, for good, after the one create."""
    runpod.fail_next(status, op="create")
    with pytest.raises(ProviderError) as caught:
        await provider.provision(spec())
    assert not caught.value.transient
    # The one create; on GraphQL, which reads no catalog before it, the one call at all.
    assert len(runpod.calls("create") if api == "rest" else runpod.calls()) == 1
    assert runpod.list_pods() == []
    if status == 402:  # RunPod's words say which account problem it is
        assert "balance" in caught.value.message.lower()


async def test_400_moves_to_the_next_candidate(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    runpod.fail_next(400, op="create")  # RunPod's no-capacity answer, once
    worker = await provider.provision(spec())
    attempts = tried(runpod)
    assert len(attempts) == 2 and attempts[0] != attempts[1]
    assert [b["status"] for b in create_bodies(runpod)] == (
        [400, 201] if api == "rest" else [200, 200]
    )  # GraphQL: in-band SUPPLY_CONSTRAINT
    [pod] = runpod.list_pods()
    assert pod.gpu_id == attempts[1] and pod.id == worker.provider_token


async def test_capacity_refusal_without_a_catalog_moves_on(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("graphql")
    runpod.set_no_capacity(L40S)
    runpod.set_no_capacity(ADA)
    await provider.provision(spec())
    assert tried(runpod) == MID
    [pod] = runpod.list_pods()
    assert pod.gpu_id == A6000


async def test_400_on_every_candidate_reports_the_last_detail(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    for n in range(3):
        runpod.fail_next(400, op="create", detail=f"refusal number {n}")
    with pytest.raises(ProviderError) as caught:
        await provider.provision(spec())
    assert "refusal number 2" in caught.value.message
    assert not isinstance(caught.value, ProviderOutOfCapacity)  # broken rules, not capacity
    assert sorted(tried(runpod), key=str) == sorted(MID)  # each candidate once
    assert runpod.list_pods() == []


async def test_no_capacity_anywhere_reports_runpods_words(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider(api, runpod_catalog_ttl_seconds=30)
    assert (await provider.available(spec())).ok  # catalog (REST) read while stock was there
    for gpu in MID:
        runpod.set_no_capacity(gpu)
    with pytest.raises(ProviderOutOfCapacity) as caught:
        await provider.provision(spec())
    assert NO_CAPACITY_MESSAGE in caught.value.message
    assert sorted(tried(runpod), key=str) == sorted(MID)
    if api == "rest":  # the stale catalog was dropped: the next look sees NONE
        assert not (await provider.available(spec())).ok


async def test_stock_gone_between_available_and_provision_is_out_of_capacity(
    make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider("rest")  # GraphQL has no catalog
    assert (await provider.available(spec())).ok
    for gpu in MID:
        runpod.set_no_capacity(gpu)
    with pytest.raises(ProviderOutOfCapacity) as caught:
        await provider.provision(spec())  # TTL 0: a fresh look at the catalog
    assert "no stock" in caught.value.message
    assert runpod.call_count("create") == 0


async def test_capacity_and_a_broken_rule_among_candidates_is_a_failure(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    """Out of capacity only when every refusal was for capacity: a broken rule on one
    candidate (a configuration to fix) makes it a plain failure."""
    runpod.fail_next(400, op="create")  # RunPod's no-capacity words
    runpod.fail_next(400, count=2, op="create", detail="gpu.count exceeds the maximum")
    with pytest.raises(ProviderError) as caught:
        await provider.provision(spec())
    assert not isinstance(caught.value, ProviderOutOfCapacity)
    assert NO_CAPACITY_MESSAGE in caught.value.message
    assert "gpu.count exceeds the maximum" in caught.value.message


async def test_401_fails_fast_and_marks_the_provider_unavailable(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider(api, key="rpk-wrong-" + uuid.uuid4().hex)
    if api == "rest":
        # The catalog read by available() is the first call: refused, so not available.
        availability = await provider.available(spec())
        assert not availability.ok and "401" in availability.reason
        assert len(runpod.calls()) == 1
    with pytest.raises(ProviderError) as caught:
        await provider.provision(spec(GpuClass.entry))
    assert not caught.value.transient and "401" in caught.value.message
    assert runpod.call_count("create") <= 1 and runpod.list_pods() == []
    calls = len(runpod.calls())
    for gpu in (GpuClass.entry, GpuClass.mid, GpuClass.high):
        availability = await provider.available(spec(gpu))
        assert not availability.ok and "RUNPOD_API_KEY" in availability.reason
    assert len(runpod.calls()) == calls  # known bad: not asked again

    good = make_provider(api)
    runpod.fail_next(401, op="create")
    creates = runpod.call_count("create")
    with pytest.raises(ProviderError):
        await good.provision(spec())
    assert runpod.call_count("create") == creates + 1  # no second candidate after a 401
    assert not (await good.available(spec())).ok


async def test_403_skips_the_candidate(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    runpod.fail_next(403, count=2, op="create")
    worker = await provider.provision(spec())
    attempts = tried(runpod)
    assert len(attempts) == 3 and len(set(attempts)) == 3
    [pod] = runpod.list_pods()
    assert pod.gpu_id == attempts[2] and pod.id == worker.provider_token


async def test_429_waits_retry_after_then_creates(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    runpod.fail_next(429, op="create", retry_after=1)
    started = time.monotonic()
    await provider.provision(spec())
    assert time.monotonic() - started >= 0.95
    statuses = [b["status"] for b in create_bodies(runpod)]
    assert statuses == [429, 201 if api == "rest" else 200]
    assert len(set(tried(runpod))) == 1  # the same call again, not the next candidate
    assert len(runpod.list_pods()) == 1


@pytest.mark.parametrize("status", [500, 503])
async def test_5xx_before_the_create_looks_up_then_creates_again(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator, status: int
) -> None:
    runpod.fail_next(status, op="create")
    worker = await provider.provision(spec())
    assert runpod.call_count("create") == 2 and len(set(tried(runpod))) == 1
    kinds = [c.kind for c in runpod.calls() if c.kind in ("create", "list")]
    assert kinds == ["create", "list", "create"]  # looked up by name before creating again
    [pod] = runpod.list_pods()
    assert pod.id == worker.provider_token


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_5xx_after_the_create_leaves_exactly_one_pod(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator, status: int
) -> None:
    runpod.fail_next(status, op="create", after_create=True)
    worker_spec = spec()
    worker = await provider.provision(worker_spec)
    assert runpod.call_count("create") == 1
    [pod] = runpod.list_pods()
    assert pod.id == worker.provider_token
    assert pod.name == provider.pod_name(worker_spec.lease_id)
    assert worker.endpoint == f"https://{pod.id}-8080.proxy.runpod.net"


async def test_5xx_that_persists_gives_up_without_leaving_pods(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    runpod.fail_next(500, count=3, op="create")
    with pytest.raises(ProviderError) as caught:
        await provider.provision(spec())
    assert caught.value.transient
    assert runpod.call_count("create") == 3 and runpod.list_pods() == []


async def test_timed_out_create_is_looked_up_by_name(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider(api, runpod_request_timeout_seconds=0.3)
    runpod.set_delay(0.6, op="create")  # answered after the client gave up; made anyway
    worker = await provider.provision(spec())
    assert runpod.call_count("create") == 1
    [pod] = runpod.list_pods()
    assert pod.id == worker.provider_token


async def test_duplicates_found_by_name_are_destroyed(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    """Names are not unique at RunPod: when the look-up after a lost create answer finds
    several pods of this lease, one is kept and the others destroyed."""
    worker_spec = spec()
    name = provider.pod_name(worker_spec.lease_id)
    await make_pod(provider, name)
    runpod.fail_next(500, op="create", after_create=True)
    worker = await provider.provision(worker_spec)
    [pod] = runpod.list_pods()
    assert pod.id == worker.provider_token and pod.name == name


async def test_pod_that_dies_while_starting_is_destroyed(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    task, pod = await left_starting(runpod, provider.provision(spec()))
    runpod.set_pod_status(pod.id, "EXITED")
    with pytest.raises(ProviderError) as caught:
        await asyncio.wait_for(task, 10)
    assert "EXITED" in caught.value.message
    assert runpod.list_pods() == []


async def test_dead_pod_that_cannot_be_terminated_still_fails_cleanly(
    api: str, make_stack: Callable[..., Awaitable[Stack]], runpod: RunPodEmulator
) -> None:
    """The provider's error stays a ProviderError (never a raw client error, which the
    service would answer with a 500), and the service's clean-up by name removes the pod."""
    stack = await make_stack(api)
    request = LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.mid)
    task, pod = await left_starting(runpod, stack.service.acquire(request))
    runpod.fail_next(500, count=4, op="terminate")  # every try of the first terminate
    runpod.set_pod_status(pod.id, "ERROR" if api == "rest" else "EXITED")
    with pytest.raises(ProvisionFailed) as caught:
        await asyncio.wait_for(task, 20)
    assert "while starting" in caught.value.details["failures"]["runpod"]
    assert runpod.list_pods() == []
    assert await stack.service.store.count_by_state() == {"failed": 1}


async def test_a_fast_pod_is_not_kept_waiting_a_whole_poll_interval(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = polling(make_provider, runpod, api, every=10, pods_run_after=0)
    started = time.monotonic()
    await provider.provision(spec())
    assert time.monotonic() - started < 5  # well within the 10 s poll interval


async def test_the_look_that_sees_a_pod_run_is_its_last(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    """The start watcher stops with its last pod settled: no call after the read that saw
    the pod run. It used to look once more (a list of nothing, or, when that read took
    longer than the poll interval, the same read again); a call so left in flight once
    landed on the emulator after the next test had reset it (a machine loaded past its
    cores)."""
    provider = polling(make_provider, runpod, api, every=0.5, pods_run_after=0.3)
    worker = await provider.provision(spec())
    returned = time.time()
    await until(lambda: not provider.starting.watching, "the start watcher to stop")
    after = [(c.op, c.pod_id) for c in runpod.calls() if c.at >= returned]
    assert after == [], after
    reads = runpod.calls("read")
    assert reads and reads[-1].pod_id == worker.provider_token
    assert runpod.call_count("list") == 0


async def test_pod_that_vanishes_while_starting_fails_the_provision(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    task, pod = await left_starting(runpod, provider.provision(spec()))
    runpod.vanish_pod(pod.id)
    with pytest.raises(ProviderError) as caught:
        await asyncio.wait_for(task, 10)
    assert "disappeared" in caught.value.message


async def test_many_starting_pods_cost_one_call_per_round(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = polling(make_provider, runpod, api, every=0.1, pods_run_after=1.0)
    started = time.monotonic()
    workers = await asyncio.gather(*(provider.provision(spec()) for _ in range(20)))
    took = time.monotonic() - started
    assert len({w.provider_token for w in workers}) == 20
    assert all(p.status == "RUNNING" for p in runpod.list_pods())
    looks = runpod.call_count("read") + runpod.call_count("list")
    # One pod polled alone would be read ~10 times in that second; 20 of them ~200 times.
    assert looks <= 3 * took / 0.1 + 5, (looks, took)
    assert runpod.call_count("list") >= 1


async def test_a_steady_stream_of_new_pods_never_postpones_the_look(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    """A new pod arriving more often than the poll interval must not keep resetting the
    shared watcher's wait: the first pods are seen running while the stream still
    lasts, not only once it ends."""
    provider = polling(make_provider, runpod, api, every=0.5, pods_run_after=0.3)
    tasks = []
    for _ in range(100):  # one new pod every 50 ms for 5 s (or longer, on a loaded host)
        tasks.append(asyncio.ensure_future(provider.provision(spec())))
        # sleep: the stream's pace is the case itself (new pods more often than the poll
        # interval, for several intervals); nothing but time can space the arrivals.
        await asyncio.sleep(0.05)
    # The first ten arrived within its first half second: each is running 0.3 s after its
    # create and seen at the next look, 0.5 s later, about 0.8 s in, when ~85 more are
    # still to come. A postponed look would have seen none of them yet. (Counted in
    # pods, not seconds: a loaded host slows the stream and the looks alike; with ten
    # workers and three busy loops on two cores, some provisions took 4.2 s.)
    seen_while_arriving = [task.done() for task in tasks[:10]]
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert all(seen_while_arriving), seen_while_arriving
    assert len(runpod.list_pods()) == 100


async def test_one_bad_pod_among_many_fails_alone(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = polling(make_provider, runpod, api, every=0.1, pods_run_after=2.0)
    specs = [spec() for _ in range(6)]
    tasks = [asyncio.ensure_future(provider.provision(s)) for s in specs]
    await until(lambda: len(runpod.list_pods()) >= 6, "the 6 pods to be created")
    by_name = {p.name: p.id for p in runpod.list_pods()}
    vanished = by_name[provider.pod_name(specs[0].lease_id)]
    died = by_name[provider.pod_name(specs[1].lease_id)]
    runpod.vanish_pod(vanished)
    runpod.set_pod_status(died, "EXITED")
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
    assert isinstance(results[0], ProviderError) and "disappeared" in results[0].message
    assert isinstance(results[1], ProviderError) and "EXITED" in results[1].message
    assert (
        [r.provider_token for r in results[2:]]
        == [  # type: ignore[union-attr]
            by_name[provider.pod_name(s.lease_id)] for s in specs[2:]
        ]
    )
    assert died not in {p.id for p in runpod.list_pods()}  # the dead one was terminated


async def test_a_cancelled_wait_leaves_the_others_waiting(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = polling(make_provider, runpod, api, every=0.1, pods_run_after=1.0)
    first = asyncio.ensure_future(provider.provision(spec()))
    second = asyncio.ensure_future(provider.provision(spec()))
    await until(lambda: len(runpod.list_pods()) >= 2, "both pods to be created")
    first.cancel()  # as the service's provision timeout does
    worker = await asyncio.wait_for(second, 10)
    assert worker.provider_token in {p.id for p in runpod.list_pods()}
    assert provider.starting.pending == {}


async def test_passing_failures_while_waiting_are_waited_out(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    runpod.provision_delay = 0.5
    runpod.fail_next(503, count=5, op="read")
    runpod.fail_next(429, op="read", retry_after=0)
    worker = await provider.provision(spec())
    assert [p.id for p in runpod.list_pods()] == [worker.provider_token]


# --- release and list ---------------------------------------------------------------------


async def test_release_terminates_and_already_gone_is_success(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    worker_spec = spec()
    worker = await provider.provision(worker_spec)
    await provider.release(worker.provider_token, worker_spec.lease_id)
    assert runpod.list_pods() == []
    await provider.release(worker.provider_token, worker_spec.lease_id)  # gone: fine
    other = await provider.provision(spec())
    runpod.vanish_pod(other.provider_token)
    await provider.release(other.provider_token, "whatever")


async def test_release_without_token_destroys_every_pod_of_the_lease(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    mine, other = spec(), spec()
    for s in (mine, mine, other):
        await make_pod(provider, provider.pod_name(s.lease_id))
    await provider.release("", mine.lease_id)
    [left] = runpod.list_pods()
    assert left.name == provider.pod_name(other.lease_id)


async def test_release_failure_is_an_error(
    api: str, provider: RunPodProvider, runpod: RunPodEmulator
) -> None:
    worker = await provider.provision(spec())
    runpod.fail_next(500, count=10, op="terminate")
    with pytest.raises(ProviderError):
        await provider.release(worker.provider_token, "x")
    assert len(runpod.list_pods()) == 1


async def test_list_workers_keeps_only_this_instances_pods(
    api: str, make_provider: Callable[..., RunPodProvider], runpod: RunPodEmulator
) -> None:
    provider = make_provider(api)
    other = make_provider(api)
    a, b = spec(), spec()
    wa = await provider.provision(a)
    await other.provision(b)
    for name in (
        f"oa-{provider.instance}-not-a-uuid",
        "someone-elses-pod",
        f"oa-{provider.instance}x-{uuid.uuid4()}",
    ):
        await make_pod(provider, name)
    workers = await provider.list_workers()
    assert list(workers) == [a.lease_id]
    [info] = workers[a.lease_id]
    assert info.provider_token == wa.provider_token and info.lease_id == a.lease_id


# --- through a real LeaseService, store and loops --------------------------------------


class Clock:
    """The service's one clock (lifecycle/clock.py): the machine's, moved ahead by the test
    (`move`) where a rule waits for time to pass; wall and monotonic time move together."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def now(self) -> datetime:
        return SYSTEM_CLOCK.now() + timedelta(seconds=self.ahead)

    def monotonic(self) -> float:
        return SYSTEM_CLOCK.monotonic() + self.ahead

    def move(self, seconds: float) -> None:
        self.ahead += seconds


@dataclass
class Stack:
    service: LeaseService
    provider: RunPodProvider
    reconciler: Reconciler
    sweeper: Sweeper
    clock: Clock


@pytest.fixture
async def make_stack(
    tmp_path: Path, make_provider: Callable[..., RunPodProvider]
) -> AsyncIterator[Callable[..., Awaitable[Stack]]]:
    stores: list[LeaseStore] = []

    async def make(api: str, **overrides: Any) -> Stack:
        store = open_store(f"sqlite:///{tmp_path / f'runpod-{len(stores)}.db'}", states=STATE_SETS)
        stores.append(store)
        await store.migrate()
        provider = make_provider(api, **overrides)
        clock = Clock()
        service = LeaseService(
            store,
            [provider],
            OrderedFirstAvailable(),
            Metrics(),
            NoOpTracer(),
            clock=clock,
            provision_timeout=20,
        )
        reconciler = Reconciler(service, NoOpTracer(), 60, replica_timeout=30)
        sweeper = Sweeper(service, Alarm(clock), NoOpTracer(), 60)
        return Stack(service, provider, reconciler, sweeper, clock)

    yield make
    for store in stores:
        await store.close()


async def test_acquire_records_the_pod_and_release_destroys_it(
    api: str, make_stack: Callable[..., Awaitable[Stack]], runpod: RunPodEmulator
) -> None:
    stack = await make_stack(api)
    record = await stack.service.acquire(
        LeaseRequest(kind=WorkerKind.anim, gpu=GpuClass.high, ttl_seconds=120)
    )
    [pod] = runpod.list_pods()
    assert record.provider == "runpod" and record.state == "active"
    assert record.provider_token == pod.id
    assert record.endpoint == f"https://{pod.id}-8080.proxy.runpod.net"
    assert pod.env["LEASE_ID"] == record.lease_id
    assert pod.env["LEASE_EXPIRES_AT"] == record.wire()["expires_at"]
    await stack.service.release(record.lease_id, None)
    assert runpod.list_pods() == []
    stored = await stack.service.store.get(record.lease_id)
    assert stored is not None and stored.state == "released"


async def test_no_stock_is_503_naming_runpods_reason(
    make_stack: Callable[..., Awaitable[Stack]], runpod: RunPodEmulator
) -> None:
    stack = await make_stack("rest")
    for gpu in MID:
        runpod.set_no_capacity(gpu)
    with pytest.raises(NoProviderAvailable) as caught:
        await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.mid))
    assert "no stock" in caught.value.details["reasons"]["runpod"]
    assert runpod.call_count("create") == 0


async def test_no_capacity_at_create_is_503_and_the_lease_row_ends_failed(
    api: str, make_stack: Callable[..., Awaitable[Stack]], runpod: RunPodEmulator
) -> None:
    stack = await make_stack(api)
    for gpu in MID:
        runpod.set_no_capacity_at_create(gpu)
    with pytest.raises(NoProviderAvailable) as caught:
        await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.mid))
    assert NO_CAPACITY_MESSAGE in caught.value.details["reasons"]["runpod"]
    assert caught.value.retry_after is not None and caught.value.retry_after >= 1
    assert runpod.call_count("create") == 3 and runpod.list_pods() == []
    # The row written before the provider was called is not left `provisioning`.
    assert await stack.service.store.count_by_state() == {"failed": 1}
    for gpu in MID:
        runpod.set_no_capacity_at_create(gpu, False)
    await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.mid))
    assert await stack.service.store.count_by_state() == {"failed": 1, "active": 1}


async def test_every_candidate_refused_is_502_with_the_last_detail(
    api: str, make_stack: Callable[..., Awaitable[Stack]], runpod: RunPodEmulator
) -> None:
    stack = await make_stack(api)
    for n in range(3):
        runpod.fail_next(400, op="create", detail=f"refusal {n}")
    with pytest.raises(ProvisionFailed) as caught:
        await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.mid))
    assert "refusal 2" in caught.value.details["failures"]["runpod"]
    assert runpod.list_pods() == []
    assert await stack.service.store.count_by_state() == {"failed": 1}


async def test_capacity_cap_of_runpod_max_pods(
    make_stack: Callable[..., Awaitable[Stack]], runpod: RunPodEmulator
) -> None:
    stack = await make_stack("rest", runpod_max_pods=1)
    await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.entry))
    with pytest.raises(NoProviderAvailable):
        await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.entry))
    assert len(runpod.list_pods()) == 1


async def test_failed_release_stays_releasing_until_the_sweeper_succeeds(
    api: str, make_stack: Callable[..., Awaitable[Stack]], runpod: RunPodEmulator
) -> None:
    stack = await make_stack(api)
    record = await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.mid))
    runpod.fail_next(503, count=4, op="terminate")  # the client's tries, all refused
    with pytest.raises(ReleaseFailed):
        await stack.service.release(record.lease_id, None)
    stored = await stack.service.store.get(record.lease_id)
    assert stored is not None and stored.state == "releasing" and stored.release_attempts == 1
    assert len(runpod.list_pods()) == 1
    stack.clock.move(1.1)  # the first retry is due after 1 s
    assert await stack.sweeper.run_once() == 1
    stored = await stack.service.store.get(record.lease_id)
    assert stored is not None and stored.state == "released"
    assert runpod.list_pods() == []


async def test_reconcile_marks_a_vanished_pods_lease_lost(
    api: str, make_stack: Callable[..., Awaitable[Stack]], runpod: RunPodEmulator
) -> None:
    stack = await make_stack(api)
    kept = await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.mid))
    gone = await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.mid))
    assert runpod.vanish_pod(gone.provider_token)
    totals = await stack.reconciler.run_once()
    assert totals == {"failed": 0, "orphans": 0, "lost": 1}
    lost = await stack.service.store.get(gone.lease_id)
    assert lost is not None and lost.state == "released" and lost.release_reason == "lost"
    still = await stack.service.store.get(kept.lease_id)
    assert still is not None and still.state == "active"
    assert [p.id for p in runpod.list_pods()] == [kept.provider_token]


async def test_reconcile_destroys_orphans_and_duplicates_only_of_this_instance(
    api: str, make_stack: Callable[..., Awaitable[Stack]], runpod: RunPodEmulator
) -> None:
    stack = await make_stack(api)
    provider = stack.provider
    record = await stack.service.acquire(LeaseRequest(kind=WorkerKind.renderer, gpu=GpuClass.mid))
    lease_pod = provider.pod_name(record.lease_id)
    await make_pod(provider, lease_pod)  # a duplicate of the lease's pod
    await make_pod(provider, lease_pod)
    await make_pod(provider, provider.pod_name(str(uuid.uuid4())))  # an orphan: no lease at all
    foreign = [
        await make_pod(provider, f"oa-other-{uuid.uuid4()}"),
        await make_pod(provider, "hand-made"),
    ]
    totals = await stack.reconciler.run_once()
    assert totals == {"failed": 0, "orphans": 3, "lost": 0}
    assert sorted(p.id for p in runpod.list_pods()) == sorted(
        [record.provider_token, *(pod.id for pod in foreign)]
    )
    stored = await stack.service.store.get(record.lease_id)
    assert stored is not None and stored.state == "active"
    assert await stack.reconciler.run_once() == {"failed": 0, "orphans": 0, "lost": 0}
