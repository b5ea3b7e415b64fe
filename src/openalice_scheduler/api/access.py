"""One access line per request, its request id, its duration in the metrics, and its
span's name by route template.

`AccessLog` sits outside the request rules (middleware.py), so the answers they give
(400 duplicate header, 431, 401, 413, 408) are logged, timed and carry `X-Request-ID`
like the routes' own. Only what uvicorn answers itself, before the app runs (a request
it cannot parse), is not seen here."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from starlette.routing import BaseRoute, Match, Mount, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openalice_scheduler.api.errors import internal_error
from openalice_scheduler.logs import request_id
from openalice_scheduler.metrics import Metrics

log = logging.getLogger("openalice_scheduler.access")

REQUEST_ID_HEADER = b"x-request-id"
# A caller's id is kept when it is a printable ASCII token of reasonable length; anything
# else (a space, a control character, 200 characters) is replaced, never reflected.
_CALLER_ID = re.compile(rb"[!-~]{1,128}")
# Route label of a path no route serves: one series, whatever the caller asked for.
UNMATCHED = "unmatched"
# Status logged for a request that got no answer: the caller left first (nginx's code).
CALLER_LEFT = 499
# Methods as metric labels; any other (a caller may send `FOO`) is counted as `other`.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class AccessLog:
    """For every HTTP request: a request id (the caller's `X-Request-ID` when valid, a
    new uuid4 hex otherwise), echoed on the answer and set for the request's log
    records; then one `openalice_scheduler.access` line (method, route template, path,
    status, duration_ms, request_id, lease_id when the path names one) and one
    observation of `scheduler_http_request_duration_seconds{route,method,status}`.
    `routes`: the app's, to name the route of a request refused before routing."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.duration = metrics.http_request_duration
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        rid = _request_id(scope["headers"])
        # Not reset afterwards: uvicorn runs each request in a task of its own, so the
        # value ends with it, and the 500 handler (which runs outside this middleware,
        # in Starlette's ServerErrorMiddleware) still logs the traceback with it.
        request_id.set(rid)
        # On the request's span too (a no-op without tracing): trace and log meet on it.
        trace.get_current_span().set_attribute("request_id", rid)
        echoed = (b"x-request-id", rid.encode())
        status = 0

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), echoed]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            if not status:
                # The route failed unexpectedly: answered here, as the 500 handler would
                # answer, so that this answer too carries its request id.
                await internal_error()(scope, receive, send_with_id)
            raise
        finally:
            self._record(scope, status or CALLER_LEFT, time.perf_counter() - started, rid)

    def _record(self, scope: Scope, status: int, seconds: float, rid: str) -> None:
        route, params = self._route(scope)
        method = scope["method"]
        # The request's span is named by route template too, never by path (lease ids
        # would make every name unique), also when the request was refused before routing.
        span = trace.get_current_span()
        span.update_name(method if route == UNMATCHED else f"{method} {route}")
        span.set_attribute("http.route", route)
        self.duration.labels(route, method if method in _METHODS else "other", str(status)).observe(
            seconds
        )
        if not log.isEnabledFor(logging.INFO):
            return
        fields: dict[str, Any] = {
            "method": method,
            "route": route,
            "path": scope["path"],
            "status": status,
            "duration_ms": round(seconds * 1000, 3),
            "request_id": rid,
        }
        if isinstance(params.get("lease_id"), str):
            fields["lease_id"] = params["lease_id"]
        # The request id in the message too: a text log shows no fields.
        log.info(
            "%s %s %d %.1f ms request_id=%s",
            method,
            scope["path"],
            status,
            seconds * 1000,
            rid,
            extra=fields,
        )

    def _route(self, scope: Scope) -> tuple[str, dict[str, Any]]:
        """The route template that served the request, and its path parameters. A
        request refused before routing was never matched: it is matched here, the way
        the router would have (a full match first, else a method mismatch)."""
        route = scope.get("route")
        if isinstance(route, Route | Mount):
            return route.path, scope.get("path_params", {})
        partial: tuple[str, dict[str, Any]] | None = None
        for candidate in self.routes:
            if not isinstance(candidate, Route | Mount):
                continue
            match, child = candidate.matches(scope)
            if match == Match.FULL:
                return candidate.path, child.get("path_params", {})
            if match == Match.PARTIAL and partial is None:
                partial = candidate.path, child.get("path_params", {})
        return partial or (UNMATCHED, {})


def _request_id(headers: Sequence[tuple[bytes, bytes]]) -> str:
    given = [value for name, value in headers if name == REQUEST_ID_HEADER]
    # Sent twice, it is ambiguous which one the caller's other services logged.
    if len(given) == 1 and _CALLER_ID.fullmatch(given[0]):
        return given[0].decode("ascii")
    return uuid.uuid4().hex
