"""The RunPod emulator speaks RunPod's HTTP: checked over real loopback HTTP with httpx."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness import wait_for
from tests.runpod_emulator import NO_CAPACITY_MESSAGE, RunPodEmulator
from tests.runpod_emulator.openapi import OpenApiSchemas

KEY = "rp-test-key-d41d8cd98f00b204"  # the emulator's (conftest's `runpod_server`)
# A new pod runs at once unless a test says otherwise: its statuses are looked at directly.
PROVISION_DELAY = 0
GPU = "NVIDIA GeForce RTX 4090"
OTHER_GPU = "NVIDIA RTX A5000"
PROBLEM = "application/problem+json"

CREATE = (
    "mutation($input: PodFindAndDeployOnDemandInput!) "
    "{ podFindAndDeployOnDemand(input: $input) { id imageName machineId desiredStatus } }"
)
TERMINATE = "mutation($input: PodTerminateInput!) { podTerminate(input: $input) }"
READ = (
    "query($input: PodFilter!) { pod(input: $input) { id name desiredStatus "
    "runtime { ports { ip isIpPublic privatePort publicPort type } } } }"
)
LIST = "query { myself { pods { id name desiredStatus env } } }"


# ---------------------------------------------------------------------- fixtures & helpers


def http_client(base_url: str, **options: Any) -> httpx.Client:
    # Plain HTTP on loopback: skip loading the CA bundle, which costs ~50 ms per client.
    return httpx.Client(base_url=base_url, verify=False, timeout=10, **options)


@pytest.fixture(scope="module")
def shared_client(runpod_server: RunPodEmulator) -> Iterator[httpx.Client]:
    with http_client(runpod_server.base_url, headers=runpod_server.auth_headers) as c:
        yield c


@pytest.fixture
def client(runpod: RunPodEmulator, shared_client: httpx.Client) -> httpx.Client:
    return shared_client


@pytest.fixture(scope="module")
def schemas() -> OpenApiSchemas:
    return OpenApiSchemas.load()


def pod_body(name: str = "oa-test-lease1", gpu: str = GPU, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": "ghcr.io/openalice/worker:1",
        "gpu": {"id": gpu, "count": 1},
        "ports": ["8080/http"],
        "env": {"LEASE_ID": "lease1", "OPENALICE_SCHEDULER_INSTANCE": "test"},
        **extra,
    }


def gql_input(name: str = "oa-test-lease1", gpu: str = GPU, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "imageName": "ghcr.io/openalice/worker:1",
        "gpuTypeId": gpu,
        "gpuCount": 1,
        "cloudType": "SECURE",
        "ports": "8080/http",
        "env": [{"key": "LEASE_ID", "value": "lease1"}],
        **extra,
    }


def gql(client: httpx.Client, query: str, variables: Any = None) -> httpx.Response:
    return client.post("/graphql", json={"query": query, "variables": variables})


def create(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/v2/pods", json=pod_body(**body))
    assert response.status_code == 201, response.text
    created: dict[str, Any] = response.json()
    return created


def assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["title"] and body["detail"]
    return body


def gql_error(response: httpx.Response, field: str) -> dict[str, Any]:
    """RunPod's in-band GraphQL failure: HTTP 200, one error, the field null."""
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["data"] == {field: None}
    error: dict[str, Any] = body["errors"][0]
    return error


# ---------------------------------------------------------------------- REST happy path


def test_rest_create_read_list_delete(client: httpx.Client, schemas: OpenApiSchemas) -> None:
    created = create(client)
    assert schemas.errors("Pod", created) == []
    assert created["status"] == "PROVISIONING" and created["runtime"] is None
    assert created["gpu"] == {"id": GPU, "count": 1}
    assert created["cost"] == 0.69

    read = client.get(f"/v2/pods/{created['id']}")
    assert read.status_code == 200 and schemas.errors("Pod", read.json()) == []

    listed = client.get("/v2/pods").json()
    assert schemas.errors("ListPodsResponse", listed) == []
    [pod] = listed["pods"]
    assert pod["env"] == {"LEASE_ID": "lease1", "OPENALICE_SCHEDULER_INSTANCE": "test"}

    deleted = client.delete(f"/v2/pods/{created['id']}")
    assert deleted.status_code == 204 and deleted.content == b""
    assert_problem(client.get(f"/v2/pods/{created['id']}"), 404)
    assert_problem(client.delete(f"/v2/pods/{created['id']}"), 404)
    assert client.get("/v2/pods").json() == {"pods": []}


def test_cpu_pod(client: httpx.Client, schemas: OpenApiSchemas) -> None:
    body = pod_body(cpu={"id": "cpu5c", "vcpuCount": 2})
    del body["gpu"]
    created = client.post("/v2/pods", json=body).json()
    assert schemas.errors("Pod", created) == []
    assert created["cpu"] == {"id": "cpu5c", "vcpuCount": 2, "memory": 4}
    assert "gpu" not in created and created["cudaVersion"] is None


def test_duplicate_names_are_allowed(client: httpx.Client) -> None:
    first, second = create(client, name="oa-x-1"), create(client, name="oa-x-1")
    assert first["id"] != second["id"]
    names = [pod["name"] for pod in client.get("/v2/pods").json()["pods"]]
    assert names == ["oa-x-1", "oa-x-1"]


def test_status_goes_provisioning_starting_running(
    runpod: RunPodEmulator, client: httpx.Client, schemas: OpenApiSchemas
) -> None:
    # STARTING from 0.5 s, RUNNING from 1 s: half a second of each, for a loaded machine
    # to look at least once in each.
    runpod.provision_delay = 1.0
    pod_id = create(client, ports=["8080/http", "22/tcp"])["id"]
    seen: list[dict[str, Any]] = []

    def running() -> bool:
        pod = client.get(f"/v2/pods/{pod_id}").json()
        if not seen or seen[-1]["status"] != pod["status"]:
            seen.append(pod)
        return bool(pod["status"] == "RUNNING")

    wait_for(running, 10, 0.03, what="the pod to run")
    assert [pod["status"] for pod in seen] == ["PROVISIONING", "STARTING", "RUNNING"]
    assert [pod["runtime"] is None for pod in seen] == [True, True, False]
    running = seen[-1]
    assert schemas.errors("Pod", running) == []
    assert running["startedAt"] and running["ssh"]["direct"]["port"] == 40001
    assert {p["private"] for p in running["runtime"]["ports"]} == {8080, 22}


def test_provision_delay_changes_apply_to_live_pods(
    runpod: RunPodEmulator, client: httpx.Client
) -> None:
    runpod.provision_delay = 1000
    pod_id = create(client)["id"]
    assert client.get(f"/v2/pods/{pod_id}").json()["status"] == "PROVISIONING"
    runpod.provision_delay = 0
    assert client.get(f"/v2/pods/{pod_id}").json()["status"] == "RUNNING"
    runpod.provision_delay = 1000  # never back to PROVISIONING once seen running
    assert client.get(f"/v2/pods/{pod_id}").json()["status"] == "RUNNING"


def test_pinned_status(runpod: RunPodEmulator, client: httpx.Client) -> None:
    pod_id = create(client)["id"]
    runpod.set_pod_status(pod_id, "ERROR")
    pod = client.get(f"/v2/pods/{pod_id}").json()
    assert pod["status"] == "ERROR" and pod["runtime"] is None
    assert gql(client, READ, {"input": {"podId": pod_id}}).json()["data"]["pod"]["runtime"] is None
    runpod.set_pod_status(pod_id, None)
    assert client.get(f"/v2/pods/{pod_id}").json()["status"] == "RUNNING"


# ---------------------------------------------------------------------- REST validation


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({**pod_body(), "bogus": 1}, "'bogus'"),
        ({**pod_body(), "gpu": {"id": GPU, "gpus": 1}}, "$.gpu: additional properties 'gpus'"),
        ({k: v for k, v in pod_body().items() if k != "name"}, "'name' is a required"),
        ({k: v for k, v in pod_body().items() if k != "image"}, "'image' is a required"),
        ({**pod_body(), "env": {"LEASE_ID": 7}}, "$.env.LEASE_ID"),
        ({**pod_body(), "cloud": "PRIVATE"}, "$.cloud"),
        ({**pod_body(), "gpu": {"id": GPU, "count": 0}}, "$.gpu.count"),
        ([pod_body()], "is not of type 'object'"),
    ],
    ids=["unknown", "unknown-nested", "no-name", "no-image", "env-int", "cloud", "count", "list"],
)
def test_create_body_breaking_the_contract_is_422(
    runpod: RunPodEmulator, client: httpx.Client, body: Any, mentions: str
) -> None:
    problem = assert_problem(client.post("/v2/pods", json=body), 422)
    assert any(mentions in error for error in problem["errors"]), problem
    assert runpod.list_pods() == []


def test_template_id_stands_in_for_image(client: httpx.Client) -> None:
    body = {k: v for k, v in pod_body().items() if k != "image"}
    response = client.post("/v2/pods", json={**body, "templateId": "tmpl123"})
    assert response.status_code == 201


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({**pod_body(), "cpu": {"id": "cpu5c", "vcpuCount": 2}}, "exactly one of gpu or cpu"),
        ({k: v for k, v in pod_body().items() if k != "gpu"}, "exactly one of gpu or cpu"),
        ({**pod_body(), "ports": ["8080"]}, "ports"),
        ({**pod_body(), "gpu": {"id": "NVIDIA Imaginary 9000"}}, "unknown GPU type"),
        ({**pod_body(), "gpu": {"id": GPU, "count": 9}}, "exceeds the maximum"),
        ({**pod_body(), "gpu": {"id": GPU, "allowedCudaVersions": ["11.0"]}}, "no longer any"),
    ],
    ids=["gpu-and-cpu", "neither", "port-format", "unknown-gpu", "too-many", "cuda"],
)
def test_create_breaking_a_handler_rule_is_400(
    client: httpx.Client, body: dict[str, Any], mentions: str
) -> None:
    problem = assert_problem(client.post("/v2/pods", json=body), 400)
    assert mentions in problem["detail"]


def test_malformed_json_is_400(client: httpx.Client) -> None:
    response = client.post("/v2/pods", content=b"{not json", headers={"content-type": "x"})
    assert "not valid JSON" in assert_problem(response, 400)["detail"]


def test_unknown_path_and_method_answer_problem_json(client: httpx.Client) -> None:
    assert_problem(client.get("/v2/nowhere"), 404)
    response = client.put("/v2/pods")
    assert_problem(response, 405)
    assert response.headers["allow"] == "GET, HEAD, POST"


# ---------------------------------------------------------------------- auth


@pytest.mark.parametrize(
    ("headers", "params"),
    [
        ({}, {}),
        ({"Authorization": "Bearer wrong-key"}, {}),
        ({"Authorization": f"Basic {KEY}"}, {}),
        ({"Authorization": KEY}, {}),
        ({}, {"api_key": KEY}),  # RunPod takes it, the driver must not: refused here
    ],
    ids=["none", "wrong", "basic", "no-scheme", "query-param"],
)
def test_bad_key_is_401_on_both_apis(
    runpod: RunPodEmulator, headers: dict[str, str], params: dict[str, str]
) -> None:
    with http_client(runpod.base_url, headers=headers, params=params) as anonymous:
        rest = anonymous.post("/v2/pods", json=pod_body())
        graphql = anonymous.post("/graphql", json={"query": LIST})
    assert_problem(rest, 401)
    assert graphql.status_code == 401
    assert graphql.json()["errors"][0]["extensions"]["code"] == "UNAUTHENTICATED"
    assert KEY not in rest.text + graphql.text
    assert runpod.list_pods() == []
    assert [call.status for call in runpod.calls()] == [401, 401]


# ---------------------------------------------------------------------- catalog


def test_catalog_lists_price_and_stock_per_data_center(
    client: httpx.Client, schemas: OpenApiSchemas
) -> None:
    response = client.get("/v2/catalog/gpus", params={"include": "AVAILABILITY", "product": "POD"})
    body = response.json()
    assert response.status_code == 200 and schemas.errors("ListGpuTypesResponse", body) == []
    by_id = {gpu["id"]: gpu for gpu in body["gpus"]}
    assert {GPU, OTHER_GPU, "NVIDIA H100 80GB HBM3"} <= set(by_id)
    rtx = by_id[GPU]
    assert rtx["price"] == {"secure": 0.69, "community": 0.34}
    assert rtx["availability"] == "HIGH"
    assert [dc["id"] for dc in rtx["dataCenters"]][:2] == ["US-TX-3", "US-KS-2"]


def test_catalog_without_include_has_no_availability(client: httpx.Client) -> None:
    gpus = client.get("/v2/catalog/gpus").json()["gpus"]
    assert all("availability" not in gpu and "dataCenters" not in gpu for gpu in gpus)


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"include": "AVAILABILITY"}, 400),
        ({"product": "POD"}, 400),
        ({"include": "PRICES", "product": "POD"}, 422),
        ({"include": "AVAILABILITY", "product": "POD", "count": "0"}, 422),
    ],
)
def test_catalog_parameter_rules(client: httpx.Client, params: dict[str, str], status: int) -> None:
    assert_problem(client.get("/v2/catalog/gpus", params=params), status)


def catalog(client: httpx.Client, **params: str) -> dict[str, dict[str, Any]]:
    query = {"include": "AVAILABILITY", "product": "POD", **params}
    return {gpu["id"]: gpu for gpu in client.get("/v2/catalog/gpus", params=query).json()["gpus"]}


def test_catalog_follows_stock_price_and_capacity_switches(
    runpod: RunPodEmulator, client: httpx.Client
) -> None:
    runpod.set_stock(GPU, "LOW")
    runpod.set_price(GPU, secure=1.23)
    runpod.set_no_capacity(OTHER_GPU)
    gpus = catalog(client)
    assert gpus[GPU]["availability"] == "LOW"
    assert gpus[GPU]["price"] == {"secure": 1.23, "community": 0.34}
    assert gpus[OTHER_GPU]["availability"] == "NONE" and "dataCenters" not in gpus[OTHER_GPU]
    assert create(client)["cost"] == 1.23  # new pods are billed at the current price


# ---------------------------------------------------------------------- capacity faults


def test_no_capacity_rest_is_400_with_detail(runpod: RunPodEmulator, client: httpx.Client) -> None:
    runpod.set_no_capacity(GPU)
    problem = assert_problem(client.post("/v2/pods", json=pod_body()), 400)
    assert problem["detail"] == NO_CAPACITY_MESSAGE
    assert "no longer any instances available" in problem["detail"]
    assert create(client, gpu=OTHER_GPU)["gpu"]["id"] == OTHER_GPU  # no fallback, no spill
    runpod.set_no_capacity(GPU, False)
    create(client)


def test_no_capacity_graphql_is_supply_constraint(
    runpod: RunPodEmulator, client: httpx.Client
) -> None:
    runpod.set_no_capacity(GPU)
    error = gql_error(gql(client, CREATE, {"input": gql_input()}), "podFindAndDeployOnDemand")
    assert error["message"] == NO_CAPACITY_MESSAGE
    assert error["extensions"]["code"] == "SUPPLY_CONSTRAINT"


def test_no_capacity_at_create_keeps_the_catalog_stock(
    runpod: RunPodEmulator, client: httpx.Client
) -> None:
    """The catalog is no promise: it still shows stock while creates are refused, with the
    same answers as a capacity miss on each API."""
    runpod.set_no_capacity_at_create(GPU)
    assert catalog(client)[GPU]["availability"] == "HIGH"
    problem = assert_problem(client.post("/v2/pods", json=pod_body()), 400)
    assert problem["detail"] == NO_CAPACITY_MESSAGE
    response = gql(client, CREATE, {"input": gql_input()})
    assert response.status_code == 200
    error = gql_error(response, "podFindAndDeployOnDemand")
    assert error["message"] == NO_CAPACITY_MESSAGE
    assert error["extensions"]["code"] == "SUPPLY_CONSTRAINT"
    assert create(client, gpu=OTHER_GPU)["gpu"]["id"] == OTHER_GPU
    assert (
        client.post("/_emulator/faults", json={"no_capacity_at_create": {GPU: False}}).status_code
        == 200
    )
    create(client)
    assert client.get("/_emulator/state").json()["faults"]["no_capacity_at_create"] == []


def test_stock_none_refuses_creates(runpod: RunPodEmulator, client: httpx.Client) -> None:
    runpod.set_stock(GPU, "NONE")
    assert_problem(client.post("/v2/pods", json=pod_body()), 400)


def test_capacity_is_used_and_given_back(runpod: RunPodEmulator, client: httpx.Client) -> None:
    runpod.set_capacity(GPU, 1)
    first = create(client)
    assert_problem(client.post("/v2/pods", json=pod_body()), 400)
    assert catalog(client)[GPU]["availability"] == "NONE"
    client.delete(f"/v2/pods/{first['id']}")
    create(client)


def test_data_centers_exist_and_hold_stock(runpod: RunPodEmulator, client: httpx.Client) -> None:
    runpod.set_data_centers(["EU-RO-1", "EU-SE-1"])
    runpod.set_data_center_stock("EU-RO-1", "NONE")
    assert create(client)["dataCenterId"] == "EU-SE-1"
    pinned = client.post("/v2/pods", json=pod_body(dataCenterIds=["EU-RO-1"]))
    assert assert_problem(pinned, 400)["detail"] == NO_CAPACITY_MESSAGE
    gone = client.post("/v2/pods", json=pod_body(dataCenterIds=["US-TX-3"]))
    assert "not found" in assert_problem(gone, 400)["detail"]
    per_dc = {dc["id"]: dc["availability"] for dc in catalog(client)[GPU]["dataCenters"]}
    assert per_dc == {"EU-RO-1": "NONE", "EU-SE-1": "HIGH"}

    runpod.set_data_center_stock("EU-SE-1", "NONE", gpu_id=GPU)
    gpus = catalog(client)
    assert gpus[GPU]["availability"] == "NONE" and gpus[OTHER_GPU]["availability"] == "HIGH"


# ---------------------------------------------------------------------- queued faults


@pytest.mark.parametrize("status", [401, 402, 403, 429, 500, 503, 599])
def test_fail_next_hits_only_the_targeted_operation(
    runpod: RunPodEmulator, client: httpx.Client, status: int
) -> None:
    runpod.fail_next(status, op="create", retry_after=7 if status == 429 else None)
    assert client.get("/v2/pods").status_code == 200
    failed = client.post("/v2/pods", json=pod_body())
    assert_problem(failed, status)
    assert failed.headers.get("retry-after") == ("7" if status == 429 else None)
    assert runpod.list_pods() == []
    create(client)  # the fault was used up
    assert [c.status for c in runpod.calls("createPod")] == [status, 201]


def test_fail_next_counts_and_defaults_to_any_call(
    runpod: RunPodEmulator, client: httpx.Client
) -> None:
    runpod.fail_next(429, count=2)
    first, second = client.get("/v2/pods"), client.get("/v2/catalog/gpus")
    assert (first.status_code, second.status_code) == (429, 429)
    assert first.headers["retry-after"] == "1"
    assert client.get("/v2/pods").status_code == 200


def test_5xx_after_the_pod_was_created(runpod: RunPodEmulator, client: httpx.Client) -> None:
    runpod.fail_next(500, after_create=True)
    assert_problem(client.post("/v2/pods", json=pod_body(name="oa-test-lost")), 500)
    [pod] = client.get("/v2/pods").json()["pods"]
    assert pod["name"] == "oa-test-lost"
    [call] = runpod.calls("create")
    assert (call.status, call.pod_id) == (500, pod["id"])
    assert runpod.call_count("createPod") == 1


def test_fault_by_kind_hits_both_apis(runpod: RunPodEmulator, client: httpx.Client) -> None:
    runpod.fail_next(503, count=2, op="list")
    assert client.get("/v2/pods").status_code == 503
    assert gql(client, LIST).status_code == 503
    assert client.get("/v2/pods").status_code == 200
    assert gql(client, LIST).status_code == 200


def test_graphql_fault_shapes(runpod: RunPodEmulator, client: httpx.Client) -> None:
    runpod.fail_next(429, op="podFindAndDeployOnDemand", retry_after=3)
    limited = gql(client, CREATE, {"input": gql_input()})
    assert limited.status_code == 429 and limited.headers["retry-after"] == "3"

    runpod.fail_next(500, op="create")
    error = gql_error(gql(client, CREATE, {"input": gql_input()}), "podFindAndDeployOnDemand")
    assert error["extensions"]["code"] == "INTERNAL_SERVER_ERROR"
    assert error["message"].startswith("Something went wrong.")

    runpod.fail_next(402, op="create")
    error = gql_error(gql(client, CREATE, {"input": gql_input()}), "podFindAndDeployOnDemand")
    assert error["extensions"]["code"] == "INSUFFICIENT_BALANCE"

    runpod.fail_next(401, op="read")
    assert gql(client, READ, {"input": {"podId": "x"}}).status_code == 401

    runpod.fail_next(500, after_create=True)
    gql_error(gql(client, CREATE, {"input": gql_input()}), "podFindAndDeployOnDemand")
    assert len(gql(client, LIST).json()["data"]["myself"]["pods"]) == 1


def test_slow_answers(runpod: RunPodEmulator, client: httpx.Client) -> None:
    runpod.set_delay(3.0, op="list")
    started = time.monotonic()
    client.get("/v2/pods")
    assert time.monotonic() - started >= 3.0
    started = time.monotonic()
    create(client)  # another call: not delayed (3 s if it were; 2 s for a loaded machine)
    assert time.monotonic() - started < 2.0
    with pytest.raises(httpx.ReadTimeout):
        client.get("/v2/pods", timeout=0.05)  # what a driver's own timeout sees
    # The client gave up on it, not the emulator, which may read it later on a loaded host:
    # once it has (logged), it is a call of the log about to be reset.
    wait_for(lambda: runpod.call_count("listPods") == 2, 10, what="the abandoned call to arrive")

    # The abandoned call finishes after a reset and must not touch the new call log.
    runpod.reset()
    assert client.get("/v2/catalog/gpus").status_code == 200
    # Its end: uvicorn's tasks of requests being answered (the emulator has no signal of
    # its own for it) are all done.
    server = runpod._server
    assert server is not None
    wait_for(lambda: not server.server_state.tasks, 10, what="the abandoned call to end")
    assert [(c.op, c.status) for c in runpod.calls()] == [("listGpuTypes", 200)]


def test_vanished_pod(runpod: RunPodEmulator, client: httpx.Client) -> None:
    pod_id = create(client)["id"]
    assert runpod.vanish_pod(pod_id)
    assert_problem(client.get(f"/v2/pods/{pod_id}"), 404)
    assert client.get("/v2/pods").json() == {"pods": []}
    assert_problem(client.delete(f"/v2/pods/{pod_id}"), 404)
    assert gql(client, READ, {"input": {"podId": pod_id}}).json() == {"data": {"pod": None}}
    error = gql_error(gql(client, TERMINATE, {"input": {"podId": pod_id}}), "podTerminate")
    assert error["message"] == "pod not found to terminate"


def test_switches_refuse_nonsense(runpod: RunPodEmulator) -> None:
    with pytest.raises(ValueError):
        runpod.fail_next(200)
    with pytest.raises(ValueError):
        runpod.fail_next(500, op="reboot")
    with pytest.raises(ValueError):
        runpod.fail_next(500, op="list", after_create=True)
    with pytest.raises(ValueError):
        runpod.set_stock(GPU, "PLENTY")
    with pytest.raises(ValueError):
        runpod.provision_delay = -1


# ---------------------------------------------------------------------- GraphQL


def test_graphql_create_read_list_terminate(runpod: RunPodEmulator, client: httpx.Client) -> None:
    created = gql(client, CREATE, {"input": gql_input(ports="8080/http,22/tcp")})
    assert created.status_code == 200
    pod = created.json()["data"]["podFindAndDeployOnDemand"]
    assert set(pod) == {"id", "imageName", "machineId", "desiredStatus"}  # only what was asked
    assert pod["desiredStatus"] == "RUNNING" and pod["imageName"] == "ghcr.io/openalice/worker:1"

    read = gql(client, READ, {"input": {"podId": pod["id"]}}).json()["data"]["pod"]
    assert read["name"] == "oa-test-lease1"
    ports = {p["privatePort"]: p for p in read["runtime"]["ports"]}
    assert ports[22]["isIpPublic"] and not ports[8080]["isIpPublic"]

    [listed] = gql(client, LIST).json()["data"]["myself"]["pods"]
    assert listed["env"] == ["LEASE_ID=lease1"]
    assert client.get(f"/v2/pods/{pod['id']}").json()["env"] == {"LEASE_ID": "lease1"}

    terminated = gql(client, TERMINATE, {"input": {"podId": pod["id"]}})
    assert terminated.json() == {"data": {"podTerminate": None}}
    assert gql(client, READ, {"input": {"podId": pod["id"]}}).json()["data"]["pod"] is None
    assert runpod.list_pods() == []


def test_graphql_runtime_is_null_until_running(
    runpod: RunPodEmulator, client: httpx.Client
) -> None:
    runpod.provision_delay = 1000
    pod_id = gql(client, CREATE, {"input": gql_input()}).json()["data"]["podFindAndDeployOnDemand"][
        "id"
    ]
    read = gql(client, READ, {"input": {"podId": pod_id}}).json()["data"]["pod"]
    assert read["desiredStatus"] == "RUNNING" and read["runtime"] is None


def test_graphql_aliases_typename_and_operation_name(client: httpx.Client) -> None:
    create(client)
    query = (
        "query Other { myself { id } }\n"
        "# the one we run\n"
        "query Mine { me: myself { __typename pods { podId: id machine { gpuDisplayName } } } }"
    )
    response = client.post("/graphql", json={"query": query, "operationName": "Mine"})
    me = response.json()["data"]["me"]
    assert me["__typename"] == "User"
    assert me["pods"][0]["machine"] == {"gpuDisplayName": "RTX 4090"}
    assert set(me["pods"][0]) == {"podId", "machine"}


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"{not json", "BAD_REQUEST"),
        ({"variables": {}}, "BAD_REQUEST"),
        ({"query": "{ myself { pods { id } }"}, "GRAPHQL_PARSE_FAILED"),
        ({"query": "{ myself { ...PodFields } }"}, "GRAPHQL_PARSE_FAILED"),
        ({"query": "{ podsOfEveryone { id } }"}, "GRAPHQL_VALIDATION_FAILED"),
        ({"query": "{ myself { pods { gpuName } } }"}, "GRAPHQL_VALIDATION_FAILED"),
        ({"query": "{ myself }"}, "GRAPHQL_VALIDATION_FAILED"),
        ({"query": "query { podTerminate(input: $input) }"}, "GRAPHQL_VALIDATION_FAILED"),
        ({"query": 'query { pod(input: {podId: "abc"}) { id } }'}, "BAD_USER_INPUT"),
        ({"query": READ}, "BAD_USER_INPUT"),
        (
            {
                "query": READ.replace("PodFilter!", "PodTerminateInput!"),
                "variables": {"input": {"podId": "x"}},
            },
            "GRAPHQL_VALIDATION_FAILED",
        ),
        ({"query": CREATE, "variables": {"input": gql_input(gpuType="x")}}, "BAD_USER_INPUT"),
        ({"query": CREATE, "variables": {"input": gql_input(gpuCount="1")}}, "BAD_USER_INPUT"),
        ({"query": CREATE, "variables": {"input": gql_input(cloudType="ANY")}}, "BAD_USER_INPUT"),
    ],
    ids=[
        "not-json",
        "no-query",
        "syntax",
        "fragment",
        "unknown-root",
        "unknown-field",
        "no-selection",
        "mutation-as-query",
        "inline-literal",
        "missing-variable",
        "wrong-variable-type",
        "unknown-input-field",
        "wrong-input-type",
        "bad-enum",
    ],
)
def test_graphql_malformed_request_is_400(
    runpod: RunPodEmulator, client: httpx.Client, payload: Any, code: str
) -> None:
    if isinstance(payload, bytes):
        response = client.post("/graphql", content=payload)
    else:
        response = client.post("/graphql", json=payload)
    assert response.status_code == 400, response.text
    [error] = response.json()["errors"]
    assert error["extensions"]["code"] == code and error["message"]
    assert runpod.list_pods() == []


def test_graphql_in_band_input_errors(client: httpx.Client) -> None:
    no_gpu = gql_input()
    del no_gpu["gpuTypeId"]
    error = gql_error(gql(client, CREATE, {"input": no_gpu}), "podFindAndDeployOnDemand")
    assert error["extensions"]["code"] == "BAD_USER_INPUT"


# ---------------------------------------------------------------------- call log & control


def test_call_log_records_operations_but_never_the_key(
    runpod: RunPodEmulator, client: httpx.Client
) -> None:
    pod_id = create(client)["id"]
    client.get(f"/v2/pods/{pod_id}")
    gql(client, CREATE, {"input": gql_input()})
    gql(client, TERMINATE, {"input": {"podId": pod_id}})
    client.get("/_emulator/state")  # the test's own hands are not logged
    summary = [(c.api, c.method, c.path, c.op, c.kind, c.status) for c in runpod.calls()]
    assert summary == [
        ("rest", "POST", "/v2/pods", "createPod", "create", 201),
        ("rest", "GET", f"/v2/pods/{pod_id}", "getPod", "read", 200),
        ("graphql", "POST", "/graphql", "podFindAndDeployOnDemand", "create", 200),
        ("graphql", "POST", "/graphql", "podTerminate", "terminate", 200),
    ]
    assert runpod.call_count("createPod") == 1 and runpod.call_count("create") == 2
    assert runpod.calls("create")[0].body["env"]["LEASE_ID"] == "lease1"
    state = client.get("/_emulator/state").json()
    assert len(state["calls"]) == 4 and KEY not in json.dumps(state)


def test_http_control_sets_faults_and_resets(runpod: RunPodEmulator, client: httpx.Client) -> None:
    pod_id = create(client)["id"]
    settings = {
        "provision_delay": 1000,
        "no_capacity": {OTHER_GPU: True},
        "stock": {GPU: "MEDIUM"},
        "price": {GPU: {"secure": 2.5}},
        "capacity": {"NVIDIA L40S": 0},
        "data_center_stock": {"US-KS-2": {GPU: "LOW"}},
        "fail_next": [{"status": 503, "op": "catalog"}],
        "delay": {"read": 0.01},
        "pod_status": {pod_id: "EXITED"},
    }
    response = client.post("/_emulator/faults", json=settings)
    assert response.status_code == 200
    assert response.json()["fail_next"][0]["status"] == 503

    assert client.get("/v2/catalog/gpus").status_code == 503
    gpus = catalog(client)
    assert gpus[GPU]["availability"] == "MEDIUM" and gpus[GPU]["price"]["secure"] == 2.5
    assert gpus[OTHER_GPU]["availability"] == gpus["NVIDIA L40S"]["availability"] == "NONE"
    exited = client.get(f"/v2/pods/{pod_id}").json()
    assert exited["status"] == "EXITED" and exited["cost"] == 0.0
    assert create(client)["status"] == "PROVISIONING"

    vanished = client.post("/_emulator/faults", json={"vanish_pods": [pod_id]})
    assert vanished.json()["vanished_pods"] == [pod_id]
    state = client.get("/_emulator/state").json()
    assert len(state["pods"]) == 1 and state["faults"]["provision_delay"] == 1000

    assert client.post("/_emulator/reset").status_code == 204
    state = client.get("/_emulator/state").json()
    assert state["pods"] == [] and state["calls"] == [] and state["faults"]["fail_next"] == []


def test_a_pods_proxy_url_answers_only_once_switched_on(
    runpod: RunPodEmulator, client: httpx.Client
) -> None:
    pod_id = create(client)["id"]
    url = runpod.proxy_url.format(pod_id=pod_id, port=8080)
    assert client.get(url + "/healthz").status_code == 502  # nothing listens by default

    assert (
        client.post("/_emulator/faults", json={"pods_answer_after": 1000}).json()[
            "pods_answer_after"
        ]
        == 1000
    )
    assert client.get(url + "/healthz").status_code == 502  # not yet

    client.post("/_emulator/faults", json={"pods_answer_after": 0})
    answer = client.get(url + "/healthz")
    assert answer.status_code == 200
    assert answer.json() == {"pod_id": pod_id, "port": 8080, "path": "/healthz"}
    # Only the pod's declared HTTP port, and only a pod that exists, answers.
    assert client.get(runpod.proxy_url.format(pod_id=pod_id, port=9999)).status_code == 502
    assert client.get(runpod.proxy_url.format(pod_id="nosuchpod", port=8080)).status_code == 502
    assert runpod.proxy_hits(pod_id) == 4


@pytest.mark.parametrize(
    "settings",
    [
        {"no_capacity_for": [GPU]},
        {"fail_next": [{"status": 200}]},
        {"fail_next": [{"status": 500, "op": "reboot"}]},
        {"stock": {GPU: "PLENTY"}},
        {"delay": {"everything": 1}},
    ],
)
def test_http_control_rejects_unknown_settings(client: httpx.Client, settings: Any) -> None:
    assert_problem(client.post("/_emulator/faults", json=settings), 422)


def test_http_control_refuses_unknown_pod(client: httpx.Client) -> None:
    assert_problem(client.post("/_emulator/faults", json={"pod_status": {"x": "ERROR"}}), 400)


# ---------------------------------------------------------------------- server plumbing


def test_two_emulators_are_independent_and_stop_cleanly() -> None:
    with RunPodEmulator("a") as first, RunPodEmulator("b") as second:
        assert first.port != second.port
        with http_client(first.base_url, headers=first.auth_headers) as c:
            assert c.post("/v2/pods", json=pod_body()).status_code == 201
        assert len(first.list_pods()) == 1 and second.list_pods() == []
        url = second.base_url
    with http_client(url) as c, pytest.raises(httpx.ConnectError):
        c.get("/v2/pods")


def test_runs_as_a_separate_process() -> None:
    repo = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "tests.runpod_emulator", "--port", "0", "--api-key", "k"]
    with subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, text=True) as process:
        try:
            assert process.stdout is not None
            base_url = process.stdout.readline().strip()
            assert base_url.startswith("http://127.0.0.1:")
            with http_client(base_url, headers={"Authorization": "Bearer k"}) as c:
                c.post("/_emulator/faults", json={"fail_next": [{"status": 503}]})
                assert c.get("/v2/pods").status_code == 503
                assert c.get("/v2/pods").json() == {"pods": []}
        finally:
            process.terminate()
            assert process.wait(timeout=10) == 0


def test_validates_against_the_schema_file_in_the_repository(
    runpod: RunPodEmulator, client: httpx.Client
) -> None:
    """The emulator's 422s come from the repository's schema file, which says where and when
    it was taken from RunPod: a clone alone has everything the emulator reads."""
    repo = Path(__file__).resolve().parents[1]
    path = runpod.schemas.path
    assert path is not None and path.is_file() and path.is_relative_to(repo)
    document = json.loads(path.read_text(encoding="utf-8"))
    source = document["x-source"]
    assert source["url"].startswith("https://") and source["url"].endswith("/openapi.json")
    assert source["version"] == document["info"]["version"]
    assert date.fromisoformat(source["taken"]).year >= 2026
    assert "description" not in document["components"]["schemas"]["CreatePodRequest"]

    clouds = document["components"]["schemas"]["Cloud"]["enum"]
    assert "PRIVATE" not in clouds
    wrong_enum = assert_problem(client.post("/v2/pods", json=pod_body(cloud="PRIVATE")), 422)
    assert [e for e in wrong_enum["errors"] if e.startswith("$.cloud:")], wrong_enum
    unknown = assert_problem(client.post("/v2/pods", json=pod_body(shape="tall")), 422)
    assert unknown["errors"] == ["$: additional properties 'shape' not allowed"]
    assert runpod.list_pods() == []

    for index, cloud in enumerate(clouds):  # the same body, the forbidden field removed
        response = client.post("/v2/pods", json=pod_body(name=f"oa-test-{index}", cloud=cloud))
        assert response.status_code == 201, response.text
    assert len(runpod.list_pods()) == len(clouds)
