"""create_app(settings): the FastAPI app, its routes, rules and error handlers, around a
lifespan (lifespan.py) that wires the store, providers, loops and tracing."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from openalice_scheduler.api import (
    events,
    guard,
    lease_self,
    leases,
    middleware,
    openapi,
    ops,
    ui,
    usage,
)
from openalice_scheduler.api.access import AccessLog
from openalice_scheduler.api.errors import install_error_handlers
from openalice_scheduler.config import Settings
from openalice_scheduler.lease_access import LeaseAccess
from openalice_scheduler.lifecycle import SYSTEM_CLOCK, Clock
from openalice_scheduler.lifecycle.states import STATE_SETS
from openalice_scheduler.lifespan import lifespan
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.providers import Provider, build_providers
from openalice_scheduler.scrape import Scrape
from openalice_scheduler.store import open_store
from openalice_scheduler.tracing import RequestSpanMiddleware, Tracing, service_version


def create_app(
    settings: Settings,
    *,
    providers: Sequence[Provider] | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> FastAPI:
    providers = list(providers) if providers is not None else build_providers(settings)
    metrics = Metrics(owner_series=settings.metrics_owner_series)
    metrics.providers.set(len(providers))
    tracing = Tracing(settings)
    # Opened here, not in the lifespan: a second process on one SQLite file fails
    # before serving, with one line. Its reads select by the core's sets of states.
    store = open_store(
        settings.database_url,
        states=STATE_SETS,
        sqlite_synchronous=settings.sqlite_synchronous,
    )
    access = LeaseAccess(settings.internal_secret.get_secret_value(), settings.scheduler_public_url)
    # FastAPI whose /docs loads Swagger UI's JS, CSS and icon from the service itself
    # (ungated, under /docs/assets), not from a CDN: the docs work where only the service
    # can be reached. No /redoc: its page fetches a logo from Redocly's CDN all the same.
    # Each operation shows its id, which generated clients name their calls after.
    app = FastAPIOffline(
        static_url="/docs/assets",
        redoc_url=None,
        swagger_ui_parameters={"displayOperationId": True},
        generate_unique_id_function=openapi.operation_id,
        title="openalice-scheduler",
        version=service_version(),
        description="GPU/compute lease service: acquire and release renderer and anim "
        "workers on Docker hosts, RunPod, Modal, Kubernetes or a fixed pool of endpoints.",
        lifespan=lifespan(settings, store, providers, metrics, tracing, clock, access),
        # Spans are ours (tracing.py, exported only when configured); FastAPI's own
        # telemetry would look at the global OpenTelemetry providers on every request.
        telemetry={"tracing": False, "metrics": False, "logs": False},
        # `/v1/leases/` is a 404, not a redirect built from the caller's Host header.
        redirect_slashes=False,
    )
    app.state.metrics = metrics
    app.state.scrape = Scrape(metrics)
    app.state.settings = settings
    app.include_router(leases.router, responses={**openapi.COMMON, **openapi.GATED})
    app.include_router(events.router, responses={**openapi.COMMON, **openapi.GATED})
    app.include_router(guard.router, responses={**openapi.COMMON, **openapi.GATED})
    app.include_router(usage.router, responses={**openapi.COMMON, **openapi.GATED})
    app.include_router(lease_self.router, responses=openapi.COMMON)
    app.include_router(ops.router, responses=openapi.COMMON)
    app.include_router(ui.router)
    install_error_handlers(
        app,
        routers=[
            leases.router,
            events.router,
            guard.router,
            usage.router,
            lease_self.router,
            ops.router,
            ui.router,
            app.router,
        ],
    )
    middleware.install(
        app,
        secret=settings.internal_secret.get_secret_value(),
        cors_origins=settings.cors_origin_list,
        access=access,
    )
    # Outside the request rules: every answer, theirs too, is logged and timed.
    # Its routes name a request refused before routing (the routers' own: an included
    # router does not list its routes in app.routes).
    app.add_middleware(
        AccessLog,
        metrics=metrics,
        routes=[
            *app.routes,
            *leases.router.routes,
            *events.router.routes,
            *guard.router.routes,
            *usage.router.routes,
            *lease_self.router.routes,
            *ops.router.routes,
            *ui.router.routes,
        ],
    )
    # Outermost: the request's span (or, tracing off, the caller's trace context) is the
    # current one for everything below, the access line included.
    app.add_middleware(RequestSpanMiddleware, tracer=tracing.tracer if tracing.enabled else None)
    return app
