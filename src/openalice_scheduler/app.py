"""create_app(settings): the lifespan wires store, providers, loops and tracing."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hmac
import logging
import os
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
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
from openalice_scheduler.loops import Heartbeat, Reconciler, Sweeper
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.policy import build_policy
from openalice_scheduler.providers import Provider, build_providers
from openalice_scheduler.service import Clock, LeaseService, utcnow
from openalice_scheduler.store import LeaseStore
from openalice_scheduler.tracing import RequestSpanMiddleware, Tracing, service_version

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1024 * 1024
STARTUP_RECONCILE_TIMEOUT_S = 60.0


class StartupError(RuntimeError):
    """The service cannot start; the message says why in one line."""


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
    store = LeaseStore(settings.database_url, sqlite_synchronous=settings.sqlite_synchronous)
    # Taken here, not in the lifespan, so that a second process fails before serving,
    # with one line.
    lock = _lock_sqlite(store.sqlite_path)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Blocking SDK calls (Docker) run in threads: enough of them for parallel provisions.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=64, thread_name_prefix="provider")
        )
        try:
            await store.migrate()
            service = LeaseService(
                store, providers, build_policy(settings.policy), metrics, tracing.tracer,
                provision_timeout=settings.provision_timeout_seconds,
                max_leases_per_owner=settings.max_leases_per_owner, clock=clock,
            )
            sweeper = Sweeper(service, tracing.tracer, settings.sweep_interval_seconds)
            beat = min(5.0, settings.reconcile_interval_seconds / 2)
            heartbeat = Heartbeat(service, beat)
            reconciler = Reconciler(
                service, tracing.tracer, settings.reconcile_interval_seconds,
                settings.provision_timeout_seconds, replica_timeout=3 * beat + 1,
                heartbeat=heartbeat,  # a store outage is not the other replicas' death
            )
            await heartbeat.run_once()
            app.state.service, app.state.sweeper, app.state.reconciler = (
                service, sweeper, reconciler,
            )
            # Before serving: resolve what a crash left, release what expired meanwhile.
            reconciled = False
            try:
                if store.dialect == "sqlite":
                    # Release claims in a lone SQLite store belong to a stopped process.
                    await store.reclaim_releases(now=service.now_us())
                await asyncio.wait_for(reconciler.run_once(), STARTUP_RECONCILE_TIMEOUT_S)
                reconciled = True
                # One sweep too, before serving: without it the leases that expired while
                # the service was down were released only by the sweeper loop, after the
                # service already answered (their workers still running at that point).
                await asyncio.wait_for(sweeper.run_once(), STARTUP_RECONCILE_TIMEOUT_S)
            except (TimeoutError, SchedulerError) as exc:
                log.warning("start-up reconciliation incomplete (%s); the loop retries",
                            type(exc).__name__)
            sweeper.start()
            # The loop's first pass comes an interval after the one just made (not a second
            # listing of every provider's workers right away), at once when that one failed.
            reconciler.start(first_wait=settings.reconcile_interval_seconds if reconciled else 0)
            heartbeat.start()
            # Waiters here hear of capacity freed on other replicas too.
            listener = asyncio.create_task(store.listen_capacity(service.capacity_freed))
            log.info("openalice-scheduler %s serving: providers=%s, store=%s",
                     service_version(), ",".join(p.name for p in providers), store.dialect)
            yield
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            await sweeper.stop()
            await reconciler.stop()
            await heartbeat.stop()
        finally:
            for provider in providers:
                await provider.close()
            await store.close()
            tracing.shutdown()
            if lock is not None:
                lock.close()

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


def _lock_sqlite(path: Path | None) -> Any:
    """Only one scheduler process may serve a SQLite file: hold an exclusive lock on a
    file beside it for the process's life."""
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(f"{path}.lock", "a+")  # noqa: SIM115 - held open for the app's life
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise StartupError(
            f"DATABASE_URL: {path} is already served by another scheduler process "
            "(SQLite allows one; use PostgreSQL for several replicas)"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
