"""create_app(settings): the lifespan wires store, providers, loops and tracing."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from openalice_scheduler.api import leases, middleware, openapi, ops
from openalice_scheduler.api.errors import install_error_handlers
from openalice_scheduler.config import Settings
from openalice_scheduler.errors import SchedulerError
from openalice_scheduler.loops import Heartbeat, Reconciler, Sweeper
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.policy import build_policy
from openalice_scheduler.providers import Provider, build_providers
from openalice_scheduler.service import Clock, LeaseService, utcnow
from openalice_scheduler.store import LeaseStore
from openalice_scheduler.tracing import RequestSpanMiddleware, Tracing, service_version

log = logging.getLogger(__name__)

STARTUP_RECONCILE_TIMEOUT_S = 60.0


class StartupError(RuntimeError):
    """The service cannot start; the message says why in one line."""


def create_app(
    settings: Settings,
    *,
    providers: Sequence[Provider] | None = None,
    clock: Clock = utcnow,
) -> FastAPI:
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

    app = FastAPI(
        title="openalice-scheduler",
        version=service_version(),
        description="GPU/compute lease service: acquire and release renderer and anim "
        "workers on local Docker or RunPod.",
        lifespan=lifespan,
        # Spans are ours (tracing.py, exported only when configured); FastAPI's own
        # telemetry would look at the global OpenTelemetry providers on every request.
        telemetry={"tracing": False, "metrics": False, "logs": False},
        # `/v1/leases/` is a 404, not a redirect built from the caller's Host header.
        redirect_slashes=False,
    )
    app.state.metrics = metrics
    app.state.settings = settings
    app.include_router(leases.router, responses={**openapi.COMMON, **openapi.GATED})
    app.include_router(ops.router, responses=openapi.COMMON)
    install_error_handlers(app, routers=[leases.router, ops.router])
    middleware.install(app, secret=settings.internal_secret.get_secret_value(),
                       cors_origins=settings.cors_origin_list)
    if tracing.enabled:  # outermost: the span sees every answer
        app.add_middleware(RequestSpanMiddleware, tracer=tracing.tracer)
    return app


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
