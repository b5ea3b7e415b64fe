"""What every RunPod call goes through before its handler: auth, slowness, queued faults.

Kept apart from the REST and GraphQL modules because both APIs share it; only the way an
error is written on the wire differs, and each API passes its own renderer for that.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .openapi import OpenApiSchemas
from .state import EmulatorState, Fault

PROBLEM_JSON = "application/problem+json"

FaultRenderer = Callable[[Fault], Response]


@dataclass(frozen=True)
class Context:
    """Per-server settings the handlers need; stored on `app.state.ctx`."""

    state: EmulatorState
    api_key: str
    schemas: OpenApiSchemas


def context(request: Request) -> Context:
    ctx: Context = request.app.state.ctx
    return ctx


class ProblemResponse(JSONResponse):
    media_type = PROBLEM_JSON


def problem(
    status: int,
    detail: str,
    *,
    errors: list[str] | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """RunPod's REST error body: `{"title", "status", "detail", "errors"?}`."""
    body: dict[str, Any] = {"title": _title(status), "status": status, "detail": detail}
    if errors:
        body["errors"] = errors
    return ProblemResponse(body, status_code=status, headers=headers)


def _title(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # a fault code with no standard phrase, e.g. 599
        return "Error"


def is_authorized(request: Request, api_key: str) -> bool:
    """Only `Authorization: Bearer <key>` counts; `?api_key=` is refused on purpose.

    RunPod still accepts the query parameter, but the driver must not use it (URLs end up in
    logs), and refusing it here is what makes a test catch a driver that does.
    """
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


async def read_json(request: Request) -> tuple[Any, str | None]:
    """The body as JSON, or an error text when it is not JSON at all (a 400, not a 422)."""
    raw = await request.body()
    try:
        return json.loads(raw), None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"request body is not valid JSON: {exc}"


async def body_for_log(request: Request) -> Any:
    """Parsed JSON body for the call log, or None; never the headers."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return None
    parsed, error = await read_json(request)
    return None if error else parsed


async def run_guarded(
    ctx: Context,
    op: str,
    handler: Callable[[], Awaitable[Response]],
    render_fault: FaultRenderer,
) -> Response:
    """Apply the slow-answer switch and any queued fault around an authorized call.

    A fault with `after_create` lets the handler run first, so the pod really exists and
    only the answer is lost: the case a driver must survive by looking the pod up by name.
    """
    delay = ctx.state.delay_for(op)
    if delay > 0:
        await asyncio.sleep(delay)
    fault = ctx.state.take_fault(op)
    if fault is not None and not fault.after_create:
        return render_fault(fault)
    response = await handler()
    if fault is not None and response.status_code < 300:
        return render_fault(fault)
    return response


def retry_after(fault: Fault) -> dict[str, str]:
    """`Retry-After` in integer seconds, as RunPod sends it; every 429 carries one."""
    if fault.retry_after is not None:
        return {"Retry-After": str(fault.retry_after)}
    return {"Retry-After": "1"} if fault.status == 429 else {}
