"""How every error is answered: one renderer (`error_response`), used by the exception
handlers below and by the middleware in middleware.py alike."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from openalice_scheduler.errors import SchedulerError

log = logging.getLogger(__name__)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


def error_response(error: SchedulerError, *, close: bool = False) -> JSONResponse:
    """The answer to `error`: its status, `{"error", "message", ...details}`, its headers.
    `close`: the connection is closed after it (a body is left unread on it)."""
    headers = dict(error.headers)
    if close:
        headers["Connection"] = "close"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def install_error_handlers(app: FastAPI, routers: Sequence[APIRouter]) -> None:
    """`routers`: every router of the app, for the `Allow` of a 405."""
    routes = [route for router in routers for route in router.routes]

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _http_error(request, exc, routes)

    app.add_exception_handler(SchedulerError, _scheduler_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid_request)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)


async def _scheduler_error(_request: Request, exc: SchedulerError) -> JSONResponse:
    return error_response(exc)


async def _invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(validation_body(exc.errors()), status_code=422)


def _http_error(
    request: Request, exc: StarletteHTTPException, routes: Sequence[BaseRoute]
) -> JSONResponse:
    if exc.status_code == 400:
        # FastAPI's only 400: a JSON body it could not decode for another reason than its
        # syntax (that one is a 422 already), raised from the decoder's own error. The
        # contract answers every unreadable body as 422 invalid_request, naming why.
        return JSONResponse(
            validation_body(
                [{"type": "body_unreadable", "loc": ("body",), "msg": _unreadable(exc.__cause__)}]
            ),
            status_code=422,
        )
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        # Starlette's Allow names the methods of the first route on the path only.
        headers["Allow"] = ", ".join(_allowed_methods(request, routes))
    return JSONResponse(
        {"error": _HTTP_CODES.get(exc.status_code, "http_error"), "message": str(exc.detail)},
        status_code=exc.status_code,
        headers=headers,
    )


def _unreadable(cause: BaseException | None) -> str:
    """Why the JSON decoder gave up on a body, in our words: its own message may quote
    the body (a number's digits), and the body may hold secrets (env values)."""
    if isinstance(cause, RecursionError):
        # The decoder recurses once per array or object: Python's recursion limit is the
        # bound, a few hundred levels, far beyond any LeaseRequest.
        return "request body is nested too deeply (arrays or objects within one another)"
    if isinstance(cause, UnicodeDecodeError):
        return "request body is not valid JSON (not UTF-8 JSON)"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        # int() refuses to read more digits than this (CVE-2020-10735), whatever the JSON.
        limit = sys.get_int_max_str_digits()
        return f"request body holds a number too long (integers have at most {limit} digits)"
    return "request body could not be read as JSON"


def internal_error() -> JSONResponse:
    """The 500 answer to a failure nobody expected: never its text (it may carry a
    secret), only where to look."""
    return error_response(SchedulerError("internal error; see the scheduler's log"))


async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
    log.error("unexpected error: %s", type(exc).__name__, exc_info=exc)
    return internal_error()


def _allowed_methods(request: Request, routes: Sequence[BaseRoute]) -> list[str]:
    """Every method some route takes on this path (a route that matches the path but not
    the method matches PARTIAL)."""
    methods: set[str] = set()
    for route in routes:
        route_methods = getattr(route, "methods", None)
        if route_methods and route.matches(request.scope)[0] != Match.NONE:
            methods |= route_methods
    return sorted(methods)


def validation_body(errors: Sequence[Any]) -> dict[str, Any]:
    """A 422 that names each offending field. Input values are never echoed: env values
    may be secrets."""
    details = []
    for error in errors:
        loc = [str(part) for part in error.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        field = ".".join(loc) or "body"
        kind = error.get("type", "")
        message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
        if kind == "json_invalid":
            field = "body"
            message = f"request body is not valid JSON ({error.get('ctx', {}).get('error', '')})"
        elif kind == "missing" and field == "body":
            message = "request body is required: a JSON LeaseRequest"
        elif kind in ("model_attributes_type", "dict_type") and field == "body":
            message = "request body must be a JSON object (Content-Type: application/json)"
        elif kind == "string_unicode":
            message = "not valid Unicode text (a lone UTF-16 surrogate escape)"
        details.append({"field": field, "message": message})
    first = details[0] if details else {"field": "body", "message": "invalid request"}
    return {
        "error": "invalid_request",
        "message": f"{first['field']}: {first['message']}",
        "field": first["field"],
        "errors": details[:20],
    }
