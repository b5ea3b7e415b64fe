"""Plain acquire and release calls are answered ahead of FastAPI (api/fast.py); anything
else goes to the routes. Both ways must give callers the same answers. A request with an
`Origin` header is never taken by the fast path, which lets these tests reach the routes
with an otherwise identical request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from tests.harness import SECRET, Scheduler

Make = Callable[..., Scheduler]
ROUTES = {"Origin": "http://example.test"}  # makes the fast path hand the call on


def shape(value: Any) -> Any:
    """The JSON's structure, with every string reduced to its type."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def test_fast_path_and_routes_answer_alike(make_scheduler: Make) -> None:
    sched = make_scheduler(PROVIDERS="static", STATIC_WORKERS="renderer=http://a:80,http://b:80")
    body = {"kind": "renderer", "ttl_seconds": 600, "owner_id": "alice"}
    fast = sched.http.post("/v1/lease", json=body)
    routed = sched.http.post("/v1/lease", json=body, headers=ROUTES)
    assert fast.status_code == routed.status_code == 200, (fast.text, routed.text)
    assert fast.headers["content-type"] == routed.headers["content-type"] == "application/json"
    assert shape(fast.json()) == shape(routed.json())
    assert list(fast.json()["lease"]) == list(routed.json()["lease"])  # same order too
    leases = [fast.json()["lease"], routed.json()["lease"]]
    assert {lease["endpoint"] for lease in leases} == {"http://a:80", "http://b:80"}
    for lease in leases:
        assert sched.http.get(f"/v1/lease/{lease['lease_id']}").json() == lease

    # Errors from the service: the same status, body and headers either way.
    full = [sched.http.post("/v1/lease", json=body, headers=h) for h in ({}, ROUTES)]
    assert [r.status_code for r in full] == [503, 503]
    assert full[0].json() == full[1].json()
    assert full[0].headers["retry-after"] == full[1].headers["retry-after"]

    lease_id = leases[0]["lease_id"]
    for owner in (None, "bob"):
        headers = {"X-Lease-Owner": owner} if owner else {}
        answers = [sched.http.delete(f"/v1/lease/{lease_id}", headers={**headers, **h})
                   for h in ({}, ROUTES)]
        assert [r.status_code for r in answers] == [403, 403]
        assert answers[0].json() == answers[1].json()
    unknown = "00000000-0000-4000-8000-000000000000"
    answers = [sched.http.delete(f"/v1/lease/{unknown}", headers=h) for h in ({}, ROUTES)]
    assert [r.status_code for r in answers] == [404, 404]
    assert answers[0].json() == answers[1].json()

    # Release: 204 with no body, either way; then the lease is released, once.
    for lease, extra in zip(leases, ({}, ROUTES), strict=True):
        done = sched.http.delete(f"/v1/lease/{lease['lease_id']}",
                                 headers={"X-Lease-Owner": "alice", **extra})
        assert done.status_code == 204 and done.content == b"", done.text
        assert "content-length" not in done.headers or done.headers["content-length"] == "0"
        stored = sched.http.get(f"/v1/lease/{lease['lease_id']}").json()
        assert (stored["state"], stored["release_reason"]) == ("released", "explicit")
    assert sched.leases() == []
    assert sched.metric("scheduler_leases_released_total", provider="static",
                        reason="explicit") == 2


def test_calls_the_fast_path_does_not_take_still_work(make_scheduler: Make) -> None:
    sched = make_scheduler(PROVIDERS="static", STATIC_WORKERS="renderer=http://a:80")
    # A chunked body (no Content-Length) goes to the routes, and succeeds.
    chunked = sched.http.post(
        "/v1/lease", content=iter([b'{"kind": ', b'"renderer"}']),
        headers={"Content-Type": "application/json"},
    )
    assert chunked.status_code == 200, chunked.text
    # An invalid body gets the routes' 422, naming the field.
    invalid = sched.http.post("/v1/lease", json={"kind": "painter"})
    assert invalid.status_code == 422 and invalid.json()["field"] == "kind", invalid.text
    # A wrong secret: 401 before anything else, on both calls.
    wrong = httpx.Client(base_url=sched.url, headers={"X-Internal-Secret": SECRET + "x"})
    assert wrong.post("/v1/lease", json={"kind": "renderer"}).status_code == 401
    lease_id = chunked.json()["lease"]["lease_id"]
    assert wrong.delete(f"/v1/lease/{lease_id}").status_code == 401
    wrong.close()
    # DELETE with a body is not a plain release: the routes answer it.
    sent = sched.http.request("DELETE", f"/v1/lease/{lease_id}", content=b"{}")
    assert sent.status_code == 204, sent.text
    assert sched.http.get(f"/v1/lease/{lease_id}").json()["state"] == "released"
