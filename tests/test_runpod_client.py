"""The RunPod client against the emulator over real HTTP, on both transports (REST v2 and
GraphQL): Bearer auth, GraphQL variables, per-call timeouts and every row of RunPod's
documented table of create failures (422, 400, 401, 402, 403, 429, 5xx) as the client
reports it (the provider's reaction to each row is in test_runpod_provider.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from openalice_scheduler.providers.runpod.client import (
    ErrorKind,
    GraphQLClient,
    PodRequest,
    RestClient,
    RunPodClient,
    RunPodError,
    build_client,
)
from tests.harness import wait_for
from tests.runpod_emulator import NO_CAPACITY_MESSAGE, RunPodEmulator
from tests.runpod_setup import make_client

KEY = "rpk-client-" + uuid.uuid4().hex
APIS = ["rest", "graphql"]
L40S = "NVIDIA L40S"


@pytest.fixture
async def client(api: str, runpod: RunPodEmulator) -> AsyncIterator[RunPodClient]:
    c = make_client(api, runpod.base_url, KEY)
    yield c
    await c.close()


def pod_request(name: str | None = None, **changes: object) -> PodRequest:
    fields: dict[str, object] = {
        "name": name or f"oa-client-{uuid.uuid4()}",
        "env": {"LEASE_ID": "x", "GREETING": "hello world", "QUOTE": 'a "b" {c}'},
        "ports": ["8080/http"],
        "image": "openalice-demo-worker:latest",
        "gpu_type_id": L40S,
    }
    fields.update(changes)
    return PodRequest(**fields)  # type: ignore[arg-type]


async def test_build_client_picks_the_transport(runpod: RunPodEmulator) -> None:
    rest = build_client("rest", KEY, runpod.base_url + "/")
    graphql = build_client("graphql", KEY, runpod.base_url)
    assert isinstance(rest, RestClient) and isinstance(graphql, GraphQLClient)
    for c in (rest, graphql):
        await c.list_pods()
        await c.close()
    assert [call.api for call in runpod.calls()] == ["rest", "graphql"]


async def test_create_read_list_terminate(
    api: str, client: RunPodClient, runpod: RunPodEmulator
) -> None:
    runpod.provision_delay = 1000  # until the test says (below)
    request = pod_request()
    pod = await client.create_pod(request)
    assert pod.name == request.name and not pod.running
    [stored] = runpod.list_pods()
    assert stored.id == pod.id and stored.name == request.name
    assert stored.env == dict(request.env) and stored.gpu_id == L40S
    assert stored.ports == ("8080/http",) and stored.image == request.image

    seen = await client.get_pod(pod.id)
    assert seen is not None and seen.id == pod.id and not seen.running
    runpod.provision_delay = 0  # its time has come: RUNNING at the next look
    seen = await client.get_pod(pod.id)
    assert seen is not None and seen.running

    [listed] = await client.list_pods()
    assert listed.id == pod.id and listed.name == request.name
    assert listed.env["GREETING"] == "hello world" and listed.env["QUOTE"] == 'a "b" {c}'

    await client.terminate_pod(pod.id)
    assert runpod.list_pods() == []
    assert await client.get_pod(pod.id) is None
    await client.terminate_pod(pod.id)  # already gone: success, not an error
    assert await client.list_pods() == []


async def test_graphql_sends_data_only_as_variables(runpod: RunPodEmulator) -> None:
    client = make_client("graphql", runpod.base_url, KEY)
    name = 'oa-inject-" } mutation { podTerminate(input: {podId: "x"}) }'
    pod = await client.create_pod(pod_request(name))
    await client.get_pod(pod.id)
    await client.terminate_pod(pod.id)
    await client.close()
    calls = runpod.calls()
    assert [c.op for c in calls] == ["podFindAndDeployOnDemand", "pod", "podTerminate"]
    for call in calls:
        assert call.status == 200 and call.path == "/graphql"
        query = call.body["query"]
        assert pod.id not in query and "oa-inject" not in query and "hello" not in query
        assert set(call.body) == {"query", "variables"}
    assert calls[0].body["variables"]["input"]["name"] == name
    assert {"key": "GREETING", "value": "hello world"} in calls[0].body["variables"]["input"]["env"]


async def test_key_travels_only_as_bearer_header(
    api: str, client: RunPodClient, runpod: RunPodEmulator
) -> None:
    # The emulator refuses `?api_key=` and anything but `Authorization: Bearer`, so these
    # calls succeeding shows the header; the recorded paths show the URL is clean.
    pod = await client.create_pod(pod_request())
    await client.get_pod(pod.id)
    await client.list_pods()
    await client.terminate_pod(pod.id)
    await client.gpu_catalog()
    assert all(c.status in (200, 201, 204) for c in runpod.calls())
    assert all(KEY not in c.path for c in runpod.calls())


async def test_rest_catalog_has_price_and_stock(runpod: RunPodEmulator) -> None:
    runpod.set_price(L40S, secure=1.23, community=0.45)
    runpod.set_stock(L40S, "LOW")
    runpod.set_data_center_stock("EU-RO-1", "NONE", gpu_id=L40S)
    client = make_client("rest", runpod.base_url, KEY)
    catalog = {gpu.id: gpu for gpu in await client.gpu_catalog() or []}
    await client.close()
    l40s = catalog[L40S]
    assert (l40s.price_secure, l40s.price_community) == (1.23, 0.45)
    assert l40s.availability == "LOW"
    assert l40s.data_centers["EU-RO-1"] == "NONE" and l40s.data_centers["US-TX-3"] == "LOW"
    [call] = runpod.calls("catalog")
    assert call.status == 200


async def test_graphql_has_no_catalog(runpod: RunPodEmulator) -> None:
    client = make_client("graphql", runpod.base_url, KEY)
    assert await client.gpu_catalog() is None
    await client.close()
    assert runpod.calls() == []


# --- the error table, row by row, on each transport ------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (422, ErrorKind.invalid),  # a contract break
        (401, ErrorKind.unauthorized),  # a key refused (here a switched fault)
        (402, ErrorKind.payment),  # the balance too low
        (403, ErrorKind.forbidden),  # no access
    ],
)
async def test_a_refused_create_fails_without_retry(
    api: str, client: RunPodClient, runpod: RunPodEmulator, status: int, kind: ErrorKind
) -> None:
    """A create refused for a reason that trying again cannot change is reported as what
    it is, at once: one call, certain, and no pod."""
    runpod.fail_next(status, op="create")
    with pytest.raises(RunPodError) as caught:
        await client.create_pod(pod_request())
    assert caught.value.kind == kind and not caught.value.uncertain
    assert runpod.call_count("create") == 1 and runpod.list_pods() == []
    if status == 402:  # RunPod's words say which account problem it is
        assert "balance" in caught.value.detail.lower()


async def test_a_body_the_api_refuses_is_invalid(
    api: str, client: RunPodClient, runpod: RunPodEmulator
) -> None:
    """A real contract break rather than a switched fault: a cloud tier neither API knows
    (REST answers 422 from the OpenAPI schema, GraphQL HTTP 400 for the bad variable)."""
    with pytest.raises(RunPodError) as caught:
        await client.create_pod(pod_request(cloud="MOON"))
    assert caught.value.kind == ErrorKind.invalid
    assert caught.value.status == (422 if api == "rest" else 400)
    assert "MOON" in caught.value.detail
    # (a GraphQL request refused before it runs is logged without an operation name)
    assert len(runpod.calls()) == 1 and runpod.list_pods() == []


async def test_400_no_capacity_is_a_rejection_with_runpods_detail(
    api: str, client: RunPodClient, runpod: RunPodEmulator
) -> None:
    runpod.set_no_capacity(L40S)
    with pytest.raises(RunPodError) as caught:
        await client.create_pod(pod_request())
    assert caught.value.kind == ErrorKind.rejected
    assert caught.value.detail == NO_CAPACITY_MESSAGE
    assert caught.value.no_capacity
    runpod.fail_next(400, op="create", detail="gpu.count exceeds the maximum")
    with pytest.raises(RunPodError) as caught:
        await client.create_pod(pod_request())
    assert caught.value.kind == ErrorKind.rejected
    assert caught.value.detail.startswith("gpu.count exceeds the maximum")
    assert not caught.value.no_capacity  # a broken rule: only the words tell them apart
    assert runpod.call_count("create") == 2


async def test_an_unknown_data_center_is_a_rejection_not_a_missing_pod(
    api: str, client: RunPodClient, runpod: RunPodEmulator
) -> None:
    """A rule refusal ("data center(s) NOPE-1 not found") lets the next candidate be tried;
    it must not be mistaken for "pod not found" (GraphQL: BAD_USER_INPUT, in-band)."""
    with pytest.raises(RunPodError) as caught:
        await client.create_pod(pod_request(data_center_ids=("NOPE-1",)))
    assert caught.value.kind == ErrorKind.rejected and "NOPE-1" in caught.value.detail
    assert runpod.list_pods() == []


async def test_401_bad_key_fails_fast(api: str, runpod: RunPodEmulator) -> None:
    client = make_client(api, runpod.base_url, "rpk-wrong-" + uuid.uuid4().hex)
    for call in (
        client.create_pod(pod_request()),
        client.list_pods(),
        client.get_pod("abc"),
        client.terminate_pod("abc"),
    ):
        with pytest.raises(RunPodError) as caught:
            await call
        assert caught.value.kind == ErrorKind.unauthorized and caught.value.status == 401
    await client.close()
    assert len(runpod.calls()) == 4  # one call each: never retried
    assert runpod.list_pods() == []


@pytest.mark.parametrize("op", ["create", "list", "read", "terminate"])
async def test_429_waits_retry_after_then_repeats_the_call(
    api: str, client: RunPodClient, runpod: RunPodEmulator, op: str
) -> None:
    pod = await client.create_pod(pod_request())
    runpod.fail_next(429, op=op, retry_after=1)
    before = runpod.call_count(op)
    started = time.monotonic()
    if op == "create":
        await client.create_pod(pod_request())
    elif op == "list":
        assert len(await client.list_pods()) == 1
    elif op == "read":
        assert await client.get_pod(pod.id) is not None
    else:
        await client.terminate_pod(pod.id)
    elapsed = time.monotonic() - started
    assert elapsed >= 0.95, f"did not wait Retry-After (took {elapsed:.2f} s)"
    assert elapsed < 15, "waited far longer than Retry-After (1 s)"  # generous: a loaded host
    calls = runpod.calls(op)[before:]
    assert [c.status for c in calls] == [
        429,
        201
        if op == "create" and api == "rest"
        else 204
        if op == "terminate" and api == "rest"
        else 200,
    ]
    assert calls[1].at - calls[0].at >= 0.95
    assert len(runpod.list_pods()) == {"create": 2, "terminate": 0}.get(op, 1)


async def test_429_that_never_ends_is_reported(
    api: str, client: RunPodClient, runpod: RunPodEmulator
) -> None:
    runpod.fail_next(429, count=10, op="list", retry_after=0)
    with pytest.raises(RunPodError) as caught:
        await client.list_pods()
    assert caught.value.kind == ErrorKind.rate_limited
    assert runpod.call_count("list") == client.retries + 1


SAFE_CALLS = [
    (api, op)
    for api in APIS
    for op in ("list", "read", "terminate", "catalog")
    if not (api == "graphql" and op == "catalog")
]  # GraphQL has no catalog call


@pytest.mark.parametrize("status", [500, 502, 503, 504])
@pytest.mark.parametrize(("api", "op"), SAFE_CALLS)
async def test_5xx_on_a_safe_call_is_retried_with_backoff(
    api: str, runpod: RunPodEmulator, status: int, op: str
) -> None:
    client = make_client(api, runpod.base_url, KEY, backoff=0.1)
    pod = await client.create_pod(pod_request())
    runpod.fail_next(status, count=2, op=op)
    started = time.monotonic()
    if op == "list":
        assert [p.id for p in await client.list_pods()] == [pod.id]
    elif op == "read":
        found = await client.get_pod(pod.id)
        assert found is not None and found.id == pod.id
    elif op == "terminate":
        await client.terminate_pod(pod.id)
        assert runpod.list_pods() == []
    else:
        assert await client.gpu_catalog()
    elapsed = time.monotonic() - started
    await client.close()
    calls = runpod.calls(op)
    assert len(calls) == 3
    # Backoff 0.1 s then 0.2 s, each jittered by 0.5..1.5: at least 0.15 s in all, and
    # each retry at least its own backoff's least after the call before it (0.05 s, then
    # 0.1 s: the wait doubles). Only lower bounds: a loaded machine adds to each gap, so
    # comparing the two gaps with each other would measure the machine, not the client.
    assert elapsed >= 0.14
    assert calls[1].at - calls[0].at >= 0.049
    assert calls[2].at - calls[1].at >= 0.099


@pytest.mark.parametrize("status", [500, 503])
async def test_5xx_that_persists_is_reported_after_the_retries(
    api: str, client: RunPodClient, runpod: RunPodEmulator, status: int
) -> None:
    runpod.fail_next(status, count=10, op="list")
    with pytest.raises(RunPodError) as caught:
        await client.list_pods()
    assert caught.value.kind == ErrorKind.server and caught.value.uncertain
    assert runpod.call_count("list") == client.retries + 1


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_5xx_on_create_is_not_repeated_by_the_client(
    api: str, client: RunPodClient, runpod: RunPodEmulator, status: int
) -> None:
    """A create is not idempotent: the client reports the 5xx as uncertain and leaves the
    look-up by name to the provider (test_runpod_provider.py)."""
    runpod.fail_next(status, op="create", after_create=True)
    with pytest.raises(RunPodError) as caught:
        await client.create_pod(pod_request())
    assert caught.value.kind == ErrorKind.server and caught.value.uncertain
    assert runpod.call_count("create") == 1
    assert len(runpod.list_pods()) == 1  # the pod was made all the same


async def test_slow_create_times_out_as_uncertain(api: str, runpod: RunPodEmulator) -> None:
    client = make_client(api, runpod.base_url, KEY, timeout=0.3)
    runpod.set_delay(4.0, op="create")
    started = time.monotonic()
    with pytest.raises(RunPodError) as caught:
        await client.create_pod(pod_request())
    # Given up at its own timeout (0.3 s), long before the answer (4 s): 2.7 s of room
    # for a loaded machine, and 1 s short of the answer.
    assert time.monotonic() - started < 3.0
    assert caught.value.kind == ErrorKind.timeout and caught.value.uncertain
    assert runpod.call_count("create") == 1
    # The call was heard: the pod lands after the client gave up.
    await asyncio.to_thread(wait_for, runpod.list_pods, 10, what="the pod to land")
    assert len(runpod.list_pods()) == 1
    await client.close()


async def test_slow_reads_are_retried_then_reported(api: str, runpod: RunPodEmulator) -> None:
    client = make_client(api, runpod.base_url, KEY, timeout=0.2)
    runpod.set_delay(0.5, op="list")
    with pytest.raises(RunPodError) as caught:
        await client.list_pods()
    assert caught.value.kind == ErrorKind.timeout
    assert runpod.call_count("list") == client.retries + 1
    runpod.set_delay(0, op="list")
    assert await client.list_pods() == []
    await client.close()


async def test_unreachable_api_is_reported(api: str) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = make_client(api, f"http://127.0.0.1:{port}", KEY, timeout=1)
    with pytest.raises(RunPodError) as caught:
        await client.list_pods()
    assert caught.value.kind == ErrorKind.unreachable
    await client.close()


@pytest.mark.parametrize("status", [400, 401, 402, 403, 422, 500, 503])
async def test_the_key_never_appears_in_an_error(
    api: str, client: RunPodClient, runpod: RunPodEmulator, status: int
) -> None:
    """Even when RunPod's answer echoes the key back, the error the client raises (and so
    every message, log line or span built from it) does not carry it."""
    runpod.fail_next(status, count=10, op="create", detail=f"token {KEY} refused")
    with pytest.raises(RunPodError) as caught:
        await client.create_pod(pod_request())
    error = caught.value
    assert KEY not in str(error) and KEY not in error.detail and KEY not in repr(error)
    assert "[redacted]" in error.detail
