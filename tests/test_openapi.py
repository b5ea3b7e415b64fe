"""/openapi.json describes what the service answers: a property-based fuzz of every
operation (schemathesis, over real HTTP against the service process), and a client
generated from the document (openapi-python-client) that drives every route."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.harness import HTTP, SECRET, Scheduler, scheduler

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
STATIC = {
    "PROVIDERS": "static",
    "STATIC_WORKERS": "renderer=http://a:80,http://b:80;anim=http://c:80",
}
# Every kind and GPU class, so that a valid acquire always finds a worker (released at
# once): a 503 here would be the contract's "no capacity", not a fault.
EVERY_CLASS = {
    "PROVIDERS": "static",
    "STATIC_WORKERS": ";".join(
        f"{kind}:{gpu}=http://{kind}-{gpu}:80"
        for kind in ("renderer", "anim")
        for gpu in ("none", "entry", "mid", "high")
    ),
}
# Each fuzz takes ~40 s of CPU on an idle host; over 180 s (the suite's per-test bound)
# with ten test workers and three busy loops on two cores.
LONG_FUZZ = pytest.mark.timeout(600)
FUZZ = settings(
    max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scheduler]:
    with scheduler(tmp_path_factory.mktemp("openapi"), **EVERY_CLASS) as sched:
        yield sched


@pytest.fixture(scope="module")
def api_schema(service: Scheduler) -> Any:
    return schemathesis.openapi.from_url(f"{service.url}/openapi.json")


@LONG_FUZZ
def test_with_the_secret_every_answer_is_documented(service: Scheduler, api_schema: Any) -> None:
    _fuzz(api_schema, service.url, secret=True)


@LONG_FUZZ
def test_without_the_secret_every_answer_is_documented(service: Scheduler, api_schema: Any) -> None:
    _fuzz(api_schema, service.url, secret=False)


def _fuzz(api_schema: Any, url: str, *, secret: bool) -> None:
    """Each operation, with valid and invalid inputs (schemathesis' Python API: one
    Hypothesis strategy per operation)."""
    for result in api_schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @FUZZ
            @given(case=operation.as_strategy(generation_mode=mode))
            def check(case: Any) -> None:
                if isinstance(case.body, dict):
                    # Not a region the static workers are not in (a documented 503), not
                    # minutes in line, no owner (so that the lease can be released below
                    # whatever the owner_id drawn).
                    case.body.pop("region", None)
                    case.body.pop("owner_id", None)
                    if isinstance(case.body.get("wait_seconds"), int):
                        case.body["wait_seconds"] = 0
                headers = {
                    k: v
                    for k, v in (case.headers or {}).items()
                    if k.lower() != "x-internal-secret"
                }
                if secret:
                    headers["X-Internal-Secret"] = SECRET
                case.headers = headers
                response = case.call_and_validate(checks=CHECKS, timeout=30)
                if not secret and case.path.startswith("/v1/"):
                    # A worker's own view also takes a lease token: a made-up one is a 403.
                    refused = (400, 401, 403) if case.path.endswith("/self") else (400, 401)
                    assert response.status_code in refused, response.text
                if response.status_code == 200 and case.path == "/v1/lease":
                    lease_id = response.json()["lease"]["lease_id"]
                    released = HTTP.delete(
                        f"{url}/v1/lease/{lease_id}", headers={"X-Internal-Secret": SECRET}
                    )
                    assert released.status_code == 204, released.text

            try:
                check()
            except Unsatisfiable:
                # No input to get wrong (no parameters, no body): nothing negative to send.
                assert mode is GenerationMode.NEGATIVE, operation.label


def test_a_generated_client_drives_every_route(make_scheduler: Any, tmp_path: Path) -> None:
    service = make_scheduler(**STATIC)  # its own: the fuzz may hold every endpoint
    spec = tmp_path / "openapi.json"
    spec.write_bytes(HTTP.get(f"{service.url}/openapi.json").content)
    config = tmp_path / "codegen.yaml"
    config.write_text("post_hooks: []\n")  # no ruff run over the generated code
    subprocess.run(
        [
            Path(sys.executable).with_name("openapi-python-client"),
            "generate",
            "--path",
            str(spec),
            "--output-path",
            str(tmp_path / "oa_client"),
            "--meta",
            "none",
            "--config",
            str(config),
        ],
        check=True,
        capture_output=True,
    )
    sys.path.insert(0, str(tmp_path))
    try:
        _drive(service, importlib.import_module("oa_client"))
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name.split(".")[0] == "oa_client"]:
            del sys.modules[name]


def _drive(service: Scheduler, package: Any) -> None:
    api = importlib.import_module("oa_client.api.leases")
    ops = importlib.import_module("oa_client.api.ops")
    models = importlib.import_module("oa_client.models")

    def call(group: Any, name: str) -> Any:
        return importlib.import_module(f"{group.__name__}.{name}")

    client = package.AuthenticatedClient(
        base_url=service.url, token=SECRET, prefix="", auth_header_name="X-Internal-Secret"
    )
    with client:
        health = call(ops, "health").sync(client=client)
        assert (health.status, health.service) == ("ok", "openalice-scheduler")

        request = models.LeaseRequest(
            kind=models.WorkerKind.ANIM, ttl_seconds=600, owner_id="alice"
        )
        acquired = call(api, "acquire_lease").sync(client=client, body=request)
        assert isinstance(acquired, models.AcquireResponse), acquired
        lease = acquired.lease
        assert (acquired.provider, lease.endpoint, lease.state) == (
            "static",
            "http://c:80",
            models.LeaseState.ACTIVE,
        )
        assert lease.expires_at > lease.created_at  # parsed as date-times

        got = call(api, "get_lease").sync(lease.lease_id, client=client)
        assert isinstance(got, models.Lease) and got.lease_id == lease.lease_id

        renew = call(api, "renew_lease")
        plain = renew.sync(lease.lease_id, client=client, x_lease_owner="alice")
        assert isinstance(plain, models.Lease), plain  # no body: the lease's own TTL
        longer = renew.sync(
            lease.lease_id,
            client=client,
            x_lease_owner="alice",
            body=models.RenewRequest(ttl_seconds=1200),
        )
        assert isinstance(longer, models.Lease) and longer.expires_at > plain.expires_at
        denied = renew.sync(lease.lease_id, client=client)
        assert isinstance(denied, models.ErrorBody) and denied.error == "forbidden"

        listed = call(api, "list_leases").sync(client=client)
        assert [found.lease_id for found in listed] == [lease.lease_id]
        filtered = call(api, "list_leases").sync(client=client, owner_id="alice", limit=5)
        assert [found.lease_id for found in filtered] == [lease.lease_id]

        providers = call(api, "list_providers").sync(client=client)
        assert [view.name for view in providers] == ["static"]
        assert providers[0].in_use == 1

        release = call(api, "release_lease")
        assert (
            release.sync_detailed(lease.lease_id, client=client, x_lease_owner="alice").status_code
            == 204
        )
        gone = release.sync(lease.lease_id, client=client, x_lease_owner="alice")
        assert isinstance(gone, models.ErrorBody) and gone.error == "lease_not_found"
        ended = call(api, "get_lease").sync(lease.lease_id, client=client)
        assert ended.state == models.LeaseState.RELEASED and ended.released_at is not None


def test_the_document_describes_the_errors_as_answered(service: Scheduler) -> None:
    """Regression: 422 was documented as FastAPI's {"detail": ...}, 503, Retry-After and
    the codes were missing, 413 was on one route, timestamps had no format, the renew
    body was anyOf [RenewRequest, null]."""
    spec = HTTP.get(f"{service.url}/openapi.json").json()
    error_body = {"$ref": "#/components/schemas/ErrorBody"}
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            expected = {"400", "408", "413", "431"} | (
                {"401", "503"} if path.startswith("/v1/") else set()
            )
            assert expected <= set(responses), (method, path)
            for status, response in responses.items():
                if int(status) >= 400:
                    assert response["content"]["application/json"]["schema"] == error_body
                    assert "`" in response["description"], (method, path, status)  # codes
            if "503" in responses:
                header = responses["503"]["headers"]["Retry-After"]
                assert header["schema"]["type"] == "integer"
    renew = spec["paths"]["/v1/lease/{lease_id}/renew"]["post"]["requestBody"]
    assert not renew.get("required", False)
    assert renew["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/RenewRequest"
    }
    lease = spec["components"]["schemas"]["Lease"]["properties"]
    assert lease["created_at"]["format"] == lease["expires_at"]["format"] == "date-time"
    assert {"type": "string", "format": "date-time"} in lease["released_at"]["anyOf"]
    details = spec["components"]["schemas"]["ErrorBody"]["properties"]
    assert {
        "field",
        "errors",
        "reasons",
        "failures",
        "limit",
        "lease_id",
        "provider",
        "cause",
        "header",
    } <= set(details)
    request = spec["components"]["schemas"]["LeaseRequest"]["properties"]
    assert request["ttl_seconds"]["type"] == request["wait_seconds"]["type"] == "integer"


def test_the_document_states_the_rules_the_server_applies(service: Scheduler) -> None:
    """Regression: the rules of LeaseRequest's `env` (64 entries, keys like shell
    variables, values of at most 4,096 bytes) and the RFC 3339 form of /v1/usage's
    `since` and `until` were not in the document, so a client or a fuzzer built from it
    sent requests the server refused. Now a request at the document's limits is
    accepted and one just past them is refused."""
    spec = HTTP.get(f"{service.url}/openapi.json").json()
    env = spec["components"]["schemas"]["LeaseRequest"]["properties"]["env"]
    entries, key = env["maxProperties"], env["propertyNames"]["pattern"]
    value = env["additionalProperties"]
    chars = value["maxLength"]
    assert (entries, chars) == (64, 1024)
    # The server counts bytes (UTF-8): the document's characters are what always fits,
    # and its description says how many bytes.
    assert "4096 bytes" in value["description"], value

    keys = ["_", "Z", "a_1", *(f"K{i}" for i in range(entries - 3))]
    assert all(re.fullmatch(key, k) for k in keys)
    widest = "\N{GRINNING FACE}" * chars  # 4 bytes each: 4096 bytes
    ascii_widest = "x" * 4096
    for fits in ({k: widest for k in keys}, {"ASCII": ascii_widest}):
        accepted = _acquire(service, fits)
        assert accepted.status_code == 200, accepted.text[:300]
        released = service.http.delete(f"/v1/lease/{accepted.json()['lease']['lease_id']}")
        assert released.status_code == 204
    too_many = {**{k: "v" for k in keys}, "ONE_MORE": "v"}
    for bad_key in ("1BAD", "BAD-KEY", "", "K\N{LATIN SMALL LETTER E WITH ACUTE}"):
        assert not re.fullmatch(key, bad_key), bad_key
    for past, field in (
        (too_many, "env"),
        *(({bad_key: "v"}, "env") for bad_key in ("1BAD", "BAD-KEY", "")),
        ({"K": widest + "\N{GRINNING FACE}"}, "env.K"),
        ({"K": ascii_widest + "x"}, "env.K"),
    ):
        refused = _acquire(service, past)
        assert refused.status_code == 422, (list(past)[:3], refused.text[:300])
        assert refused.json()["field"] == field, refused.json()

    usage = {p["name"]: p for p in spec["paths"]["/v1/usage"]["get"]["parameters"]}
    accepted_as = {
        "since": [
            "0001-01-01",
            "2020-02-29",
            "2020-11-30T12:00:00Z",
            "2020-11-30t23:59:59.123456789z",
            "2020-11-30T00:00:00+23:59",
            "2020-11-30T12:00:00-00:00",
        ],
        "until": ["9999-12-31", "9999-12-31T23:59:59.999999Z", "2020-01-02T00:00:00.5-23:59"],
    }
    just_past = [
        "0000-12-31",
        "2020-13-01",
        "2020-11-32",
        "2020-11-30T24:00:00Z",
        "2020-11-30T12:60:00Z",
        "2020-11-30T12:00:60Z",
        "2020-11-30T12:00:00",
        "2020-11-30T12:00:00+24:00",
    ]
    for name, fits in accepted_as.items():
        schema = next(s for s in usage[name]["schema"]["anyOf"] if s.get("type") == "string")
        pattern = schema["pattern"]
        for text in fits:
            assert re.fullmatch(pattern, text), (name, text)
            answer = service.http.get("/v1/usage", params={name: text})
            assert answer.status_code == 200, (name, text, answer.text)
        for text in just_past:
            assert not re.fullmatch(pattern, text), (name, text)
            answer = service.http.get("/v1/usage", params={name: text})
            assert answer.status_code == 422, (name, text, answer.text)
            assert answer.json()["field"] == name


def _acquire(service: Scheduler, env: dict[str, str]) -> httpx.Response:
    return service.http.post("/v1/lease", json={"kind": "renderer", "env": env})
