"""What /openapi.json says beyond the routes themselves: each operation's id
(`operation_id`), and the error answers: which status carries which stable codes, each
with the one error body (ErrorBody). `COMMON` holds on every route (the middleware rules),
`GATED` on the /v1 routes; `errors(...)` adds what a route itself may answer."""

from __future__ import annotations

from typing import Any

from fastapi.routing import APIRoute

from openalice_scheduler.api.middleware import BODY_TIMEOUT_S, MAX_BODY_BYTES, MAX_HEADER_BYTES
from openalice_scheduler.models import ErrorBody

Responses = dict[int | str, dict[str, Any]]

_RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds after which a retry may succeed, when known",
        "schema": {"type": "integer", "minimum": 0},
    }
}

_DESCRIPTIONS = {
    400: "`duplicate_header`: X-Internal-Secret, Authorization, X-Lease-Owner, "
    "Content-Type or Content-Length sent more than once (`header` names it)",
    401: "`unauthorized`: X-Internal-Secret missing or wrong",
    403: "`forbidden`: the lease has an owner_id and X-Lease-Owner is missing or different",
    404: "`lease_not_found`: unknown lease, released, or (renew) no longer active; "
    "`not_found`: no such path",
    408: f"`request_timeout`: the body did not arrive within {BODY_TIMEOUT_S:g} s; the "
    "connection is closed",
    409: "`lease_conflict` (release): the lease is still provisioning; (renew) "
    "`preempting`: the lease is being preempted (`preempt_at`), "
    "`past_provider_deadline`: its provider ends the worker sooner (`deadline`), "
    "`worker_lost`: its worker stopped after its hand-out (`lost_cause`, `exit_code`)",
    413: f"`body_too_large`: a body over {MAX_BODY_BYTES} bytes (`limit`)",
    422: "`invalid_request`: an invalid body, parameter or JSON; `field` names the first "
    "offending field, `errors` each",
    429: "`quota_exceeded`: the owner holds as many leases as it may (`limit`); "
    "`budget_exceeded`: a lease would break the owner's cap in money (`cap`, `limit`, "
    "`owner_cost_per_hour`, `owner_spend_24h`, `cheapest_refused_price`)",
    431: f"`headers_too_large`: request headers over {MAX_HEADER_BYTES} bytes",
    502: "`provision_failed` (acquire): every candidate provider failed, `failures` lists "
    "each; `release_failed` (release): the lease stays releasing and is retried",
    503: "`no_provider_available` (acquire): no provider can serve the request now, after "
    "`wait_seconds` (`reasons` per provider); `store_unavailable`: the state store "
    "cannot be reached (`cause`); `shutting_down` (acquire, a lease's events): the "
    "scheduler is draining after SIGTERM, also for callers waiting in line; retry after "
    "`Retry-After`, another replica answers",
}


def operation_id(route: APIRoute) -> str:
    """The route function's name (`acquire_lease`), for FastAPI's
    generate_unique_id_function. Generated clients name their calls after the operation
    id, so it must not change with a path or method, as FastAPI's own
    (`acquire_lease_v1_lease_post`) would; a new route gets one by being named well.
    Unique because the names are (tests/test_docs.py checks)."""
    return route.name


def errors(*statuses: int) -> Responses:
    """The documented answers for these statuses, each with ErrorBody."""
    responses: Responses = {}
    for status in statuses:
        response: dict[str, Any] = {"model": ErrorBody, "description": _DESCRIPTIONS[status]}
        if status in (429, 503):
            response["headers"] = _RETRY_AFTER
        responses[status] = response
    return responses


COMMON = errors(400, 408, 413, 431)
GATED = errors(401)
