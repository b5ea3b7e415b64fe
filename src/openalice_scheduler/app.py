"""create_app(settings): the lifespan wires store, providers, loops and tracing."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openalice_scheduler.api import leases, ops
from openalice_scheduler.api.fast import FastLeasePath, send_json
from openalice_scheduler.config import Settings
from openalice_scheduler.errors import BodyTooLarge, SchedulerError, Unauthorized
from openalice_scheduler.lifespan import lifespan as build_lifespan
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.providers import Provider, build_providers
from openalice_scheduler.service import Clock, utcnow
from openalice_scheduler.store import open_store
from openalice_scheduler.tracing import RequestSpanMiddleware, Tracing, service_version

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024


def create_app(
    settings: Settings,
    *,
    providers: Sequence[Provider] | None = None,
    clock: Clock = utcnow,
) -> SchedulerApp:
    providers = list(providers) if providers is not None else build_providers(settings)
    metrics = Metrics()
    metrics.providers.set(len(providers))
    tracing = Tracing(settings)
    # Opened here, not in the lifespan: a second process on one SQLite file fails
    # before serving, with one line.
    store = open_store(settings.database_url, sqlite_synchronous=settings.sqlite_synchronous)

    lifespan = build_lifespan(settings, store, providers, metrics, tracing, clock)

    app = SchedulerApp(
        title="openalice-scheduler",
        version=service_version(),
        description="GPU/compute lease service: acquire and release renderer and anim "
        "workers on local Docker or RunPod.",
        lifespan=lifespan,
        # Spans are ours (tracing.py, exported only when configured); FastAPI's own
        # telemetry would look at the global OpenTelemetry providers on every request.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.metrics = metrics
    app.state.settings = settings
    app.include_router(leases.router)
    app.include_router(ops.router)
    _install_error_handlers(app)

    # Outermost first: tracing sees everything, CORS answers preflights before the gate.
    app.add_middleware(SecretGate, secret=settings.internal_secret.get_secret_value())
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    if settings.cors_origin_list:
        origins = settings.cors_origin_list
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Content-Type", "X-Internal-Secret", "X-Lease-Owner"],
        )
    if tracing.enabled:
        app.add_middleware(RequestSpanMiddleware, tracer=tracing.tracer)
    app.fast_path = FastLeasePath(
        super(SchedulerApp, app).__call__, secret=settings.internal_secret.get_secret_value(),
        limit=MAX_BODY_BYTES, tracer=tracing.tracer if tracing.enabled else None,
        state=app.state,
    )
    return app


class SchedulerApp(FastAPI):
    """FastAPI, with the plain acquire and release calls answered ahead of its whole
    middleware stack (api/fast.py); every other request goes through that stack."""

    fast_path: FastLeasePath | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.fast_path is None:
            await super().__call__(scope, receive, send)
        else:
            await self.fast_path(scope, receive, send)


class SecretGate:
    """Gated routes (/v1/...) need X-Internal-Secret, compared in constant time."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self.secret = secret.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"x-internal-secret", b"")
            if not hmac.compare_digest(given, self.secret):
                error = Unauthorized("missing or wrong X-Internal-Secret header")
                await _send_error(send, error)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse bodies over `limit` bytes with 413 before anything parses them."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = BodyTooLarge(f"request body is larger than {self.limit} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _send_error(send, too_large)
            return
        # No (or a lying) Content-Length: read with a cap, then replay.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await _send_error(send, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _send_error(send: Send, error: SchedulerError) -> None:
    # Rendered as the exception handlers render every other error (JSONResponse).
    await send_json(send, error.status, error.body(), error.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SchedulerError)
    async def scheduler_error(_request: Request, exc: SchedulerError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(exc.errors()), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        return JSONResponse(
            {"error": codes.get(exc.status_code, "http_error"), "message": str(exc.detail)},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error: %s", type(exc).__name__, exc_info=exc)
        return JSONResponse(
            {"error": "internal_error", "message": "internal error; see the scheduler's log"},
            status_code=500,
        )


def _validation_body(errors: Sequence[Any]) -> dict[str, Any]:
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
        details.append({"field": field, "message": message})
    first = details[0] if details else {"field": "body", "message": "invalid request"}
    return {
        "error": "invalid_request",
        "message": f"{first['field']}: {first['message']}",
        "field": first["field"],
        "errors": details[:20],
    }
