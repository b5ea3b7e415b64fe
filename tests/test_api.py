"""The contract's endpoints over real HTTP: shapes, status codes, errors."""

from __future__ import annotations

import json
import re
import uuid

import httpx

from tests.harness import HTTP, SECRET, Scheduler

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z$")


def test_health_is_open_and_names_the_service(sched: Scheduler) -> None:
    response = HTTP.get(f"{sched.url}/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "service": "openalice-scheduler"}


def test_acquire_list_release_round_trip(sched: Scheduler) -> None:
    response = sched.acquire(kind="anim", correlation_id="job-7", ttl_seconds=600)
    assert response.status_code == 200, response.text
    body = response.json()
    lease = body["lease"]
    assert body["provider"] == "local-docker" == lease["provider"]
    parsed = uuid.UUID(lease["lease_id"])
    assert (str(parsed), parsed.version, parsed.variant) == (
        lease["lease_id"],
        4,
        uuid.RFC_4122,
    )  # canonical and random
    assert lease["kind"] == "anim" and lease["gpu"] == "none"
    assert lease["state"] == "active" and lease["correlation_id"] == "job-7"
    assert lease["owner_id"] is None
    assert RFC3339.match(lease["created_at"]) and RFC3339.match(lease["expires_at"])
    assert lease["endpoint"] == f"http://oa-anim-{uuid.UUID(lease['lease_id']).hex[:12]}:8080"
    assert lease["provider_token"]

    assert sched.leases() == [lease]

    assert sched.release(lease["lease_id"]).status_code == 204
    assert sched.leases() == []
    again = sched.release(lease["lease_id"])
    assert again.status_code == 404 and again.json()["error"] == "lease_not_found"


def rendered_as_every_error(body: dict) -> bytes:
    """The bytes of an error answer rendered by the app's exception handlers
    (starlette's JSONResponse: compact, UTF-8)."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def test_gated_routes_need_the_secret(sched: Scheduler) -> None:
    for method, path in [
        ("POST", "/v1/lease"),
        ("GET", "/v1/leases"),
        ("DELETE", f"/v1/lease/{uuid.uuid4()}"),
    ]:
        for headers in ({}, {"X-Internal-Secret": SECRET + "x"}, {"X-Internal-Secret": ""}):
            response = HTTP.request(
                method, f"{sched.url}{path}", headers=headers, json={"kind": "renderer"}
            )
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"] == "unauthorized"
            assert response.content == rendered_as_every_error(response.json())
    # Even a malformed body is refused for the secret first: nothing is parsed unauthenticated.
    response = HTTP.post(f"{sched.url}/v1/lease", content=b"{nope")
    assert response.status_code == 401
    assert sched.containers() == []


def test_owner_is_enforced_on_release(sched: Scheduler) -> None:
    lease = sched.lease(owner_id="anim-service")
    missing = sched.release(lease["lease_id"])
    assert missing.status_code == 403 and missing.json()["error"] == "forbidden"
    wrong = sched.release(lease["lease_id"], owner="live-control")
    assert wrong.status_code == 403
    assert len(sched.containers()) == 1
    assert sched.release(lease["lease_id"], owner="anim-service").status_code == 204
    assert sched.containers() == []


def test_unknown_lease_is_404(sched: Scheduler) -> None:
    for lease_id in (str(uuid.uuid4()), "not-a-uuid"):
        response = sched.release(lease_id)
        assert response.status_code == 404
        assert response.json()["error"] == "lease_not_found"


def _invalid(sched: Scheduler, body: object) -> dict:
    response = sched.http.post("/v1/lease", json=body)
    assert response.status_code == 422, response.text
    data = response.json()
    assert data["error"] == "invalid_request"
    return data


def test_every_lease_request_rule_is_a_422_naming_the_field(sched: Scheduler) -> None:
    cases = {
        "kind": {},
        "kind ": {"kind": "painter"},
        "gpu": {"kind": "renderer", "gpu": "ultra"},
        "correlation_id": {"kind": "renderer", "correlation_id": "c" * 129},
        "owner_id": {"kind": "renderer", "owner_id": "o" * 129},
        "region": {"kind": "renderer", "region": "r" * 65},
        "ttl_seconds": {"kind": "renderer", "ttl_seconds": 0},
        "ttl_seconds ": {"kind": "renderer", "ttl_seconds": 28801},
        "ttl_seconds  ": {"kind": "renderer", "ttl_seconds": "60"},
        "env": {"kind": "renderer", "env": {"1BAD": "x"}},
        "env ": {"kind": "renderer", "env": {"OK": "x" * 4097}},
        "env  ": {"kind": "renderer", "env": {f"K{i}": "v" for i in range(65)}},
        "env   ": {"kind": "renderer", "env": ["A=1"]},
    }
    for field, body in cases.items():
        data = _invalid(sched, body)
        assert data["field"].split(".")[0] == field.strip(), (body, data)
        assert data["message"].startswith(field.strip()), data
    # Boundaries are accepted.
    ok = sched.acquire(
        kind="renderer",
        ttl_seconds=28800,
        region=None,
        env={f"K{i}": "v" for i in range(63)} | {"BIG": "é" * 2048},
    )
    assert ok.status_code == 200, ok.text
    assert sched.release(ok.json()["lease"]["lease_id"]).status_code == 204


def test_unknown_fields_are_ignored(sched: Scheduler) -> None:
    response = sched.acquire(kind="renderer", priority="urgent", tags=["a"])
    assert response.status_code == 200, response.text
    sched.release(response.json()["lease"]["lease_id"])


def test_bad_bodies_get_clear_4xx_and_the_service_keeps_serving(sched: Scheduler) -> None:
    post = sched.http.post
    json_header = {"Content-Type": "application/json"}

    malformed = post("/v1/lease", content=b'{"kind": "renderer",', headers=json_header)
    assert malformed.status_code == 422
    assert "not valid JSON" in malformed.json()["message"]

    not_object = post("/v1/lease", content=b'["renderer"]', headers=json_header)
    assert not_object.status_code == 422

    wrong_type = post("/v1/lease", json={"kind": 3, "ttl_seconds": [1]})
    assert wrong_type.status_code == 422

    oversized = post(
        "/v1/lease",
        content=b'{"kind":"renderer","pad":"' + b"x" * (2 << 20) + b'"}',
        headers=json_header,
    )
    assert oversized.status_code == 413
    assert oversized.json()["error"] == "body_too_large"
    assert oversized.content == rendered_as_every_error(oversized.json())

    huge_env = post(
        "/v1/lease", json={"kind": "renderer", "env": {f"K{i}": "v" for i in range(10_000)}}
    )
    assert huge_env.status_code == 422
    assert huge_env.json()["field"] == "env"
    assert "10000" in huge_env.json()["message"]

    no_body = post("/v1/lease")
    assert no_body.status_code == 422

    assert sched.containers() == []
    assert HTTP.get(f"{sched.url}/health").status_code == 200
    assert sched.acquire(kind="renderer").status_code == 200


def test_error_bodies_never_echo_env_values(sched: Scheduler) -> None:
    secret_value = "sk-live-" + uuid.uuid4().hex
    response = sched.http.post(
        "/v1/lease", json={"kind": "renderer", "env": {"API_KEY": secret_value * 200}}
    )
    assert response.status_code == 422
    assert "API_KEY" in response.text
    assert secret_value not in response.text


def test_metrics_use_the_contract_names(sched: Scheduler) -> None:
    lease = sched.lease(kind="anim")
    sched.acquire(kind="renderer", region="mars")
    text = HTTP.get(f"{sched.url}/metrics").text
    for name in (
        "scheduler_up",
        "scheduler_active_leases",
        "scheduler_providers",
        "scheduler_leases_acquired_total",
        "scheduler_acquire_failures_total",
        "scheduler_provision_seconds_bucket",
        "scheduler_leases_releasing",
    ):
        assert re.search(rf"^{name}[{{ ]", text, re.MULTILINE), name
    assert sched.metric("scheduler_up") == 1
    assert sched.metric("scheduler_active_leases") == 1
    assert sched.metric("scheduler_providers") == 1
    assert (
        sched.metric(
            "scheduler_leases_acquired_total", provider="local-docker", kind="anim", gpu="none"
        )
        == 1
    )
    assert sched.metric("scheduler_acquire_failures_total", reason="no_provider") == 1
    sched.release(lease["lease_id"])
    assert (
        sched.metric("scheduler_leases_released_total", provider="local-docker", reason="explicit")
        == 1
    )
    assert sched.metric("scheduler_active_leases") == 0


def test_metrics_name_owners_only_when_the_operator_turns_it_on(make_scheduler) -> None:  # type: ignore[no-untyped-def]
    workers = "renderer=http://a:8080,http://b:8080"
    # /metrics is ungated: by default it tells nobody who the callers are.
    default = make_scheduler(PROVIDERS="static", STATIC_WORKERS=workers)
    default.lease(owner_id="anim-service")
    text = HTTP.get(f"{default.url}/metrics").text
    assert default.metric("scheduler_active_leases") == 1  # the page is really there
    assert "anim-service" not in text and "scheduler_owner_leases" not in text

    opted_in = make_scheduler(
        PROVIDERS="static", STATIC_WORKERS=workers, METRICS_OWNER_SERIES="true"
    )
    opted_in.lease(owner_id="anim-service")
    opted_in.lease(owner_id="anim-service")
    assert opted_in.metric("scheduler_owner_leases", owner="anim-service") == 2


def test_openapi_describes_what_the_service_does(sched: Scheduler) -> None:
    spec = HTTP.get(f"{sched.url}/openapi.json").json()
    paths = spec["paths"]
    assert set(paths) >= {"/v1/lease", "/v1/lease/{lease_id}", "/v1/leases", "/health", "/metrics"}
    acquire = paths["/v1/lease"]["post"]
    assert set(acquire["responses"]) >= {"200", "401", "413", "422", "502", "503"}
    assert acquire["security"] == [{"APIKeyHeader": []}]
    assert spec["components"]["securitySchemes"]["APIKeyHeader"]["name"] == "X-Internal-Secret"
    release = paths["/v1/lease/{lease_id}"]["delete"]
    assert set(release["responses"]) >= {"204", "401", "403", "404", "502"}
    request = spec["components"]["schemas"]["LeaseRequest"]
    assert request["required"] == ["kind"]
    assert request["properties"]["ttl_seconds"]["maximum"] == 28800
    assert "security" not in paths["/health"]["get"]


def test_cors_is_off_unless_configured(make_scheduler) -> None:  # type: ignore[no-untyped-def]
    closed = make_scheduler()
    preflight = {"Origin": "https://ops.example", "Access-Control-Request-Method": "POST"}
    response = httpx.options(f"{closed.url}/v1/lease", headers=preflight)
    assert "access-control-allow-origin" not in response.headers

    open_ = make_scheduler(CORS_ORIGINS="https://ops.example")
    response = httpx.options(f"{open_.url}/v1/lease", headers=preflight)
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "https://ops.example"
    other = httpx.options(
        f"{open_.url}/v1/lease", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert other.headers.get("access-control-allow-origin") != "https://evil.example"
