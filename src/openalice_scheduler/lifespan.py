"""What runs around serving: the store migrated and reconciled before the first request,
the loops started, and everything closed again at the end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from openalice_scheduler.config import Settings
from openalice_scheduler.errors import SchedulerError
from openalice_scheduler.handoff import HandOff
from openalice_scheduler.lease_access import LeaseAccess
from openalice_scheduler.lifecycle import Clock, LeaseService
from openalice_scheduler.lifecycle.admission import Budgets, Priorities
from openalice_scheduler.lifecycle.line import LINE_TIMEOUT_S
from openalice_scheduler.lifecycle.policy import build_policy
from openalice_scheduler.loops import (
    AdmissionLoop,
    Alarm,
    GuardForgetter,
    Heartbeat,
    Purger,
    Reconciler,
    Sweeper,
    WarmPool,
    Watcher,
)
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.providers import Provider
from openalice_scheduler.providers.probe import ReadyProbe
from openalice_scheduler.readiness import ReadinessCheck
from openalice_scheduler.store import LeaseStore
from openalice_scheduler.tracing import Tracing, service_version

log = logging.getLogger(__name__)

STARTUP_RECONCILE_TIMEOUT_S = 60.0
# Blocking SDK calls (Docker) run in threads: enough of them for parallel provisions.
PROVIDER_THREADS = 64


def lifespan(
    settings: Settings,
    store: LeaseStore,
    providers: Sequence[Provider],
    metrics: Metrics,
    tracing: Tracing,
    clock: Clock,
    access: LeaseAccess,
) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """The app's lifespan: sets `app.state.service` (and the loops, and `readiness`)
    while it serves."""

    @asynccontextmanager
    async def run(app: Any) -> AsyncIterator[None]:
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=PROVIDER_THREADS, thread_name_prefix="provider")
        )
        probe = ReadyProbe.from_settings(settings, metrics.ready_seconds)
        try:
            await store.migrate()
            alarm = Alarm(clock)
            # Silent this long, a replica's provisions are another's to resolve.
            replica_timeout = 3 * min(5.0, settings.reconcile_interval_seconds / 2) + 1
            # A heartbeat each second: a replica that dies takes its callers in line with
            # it within LINE_TIMEOUT_S (loops/admission.py).
            beat = 1.0
            # Tells workers of their lease: a warm one its hand-off, any one its preemption.
            handoff = HandOff(
                settings.warm_handoff_path, settings.warm_handoff_timeout_seconds, access
            )
            service = LeaseService(
                store,
                providers,
                build_policy(settings.policy),
                metrics,
                tracing.tracer,
                provision_timeout=settings.provision_timeout_seconds,
                probe=probe,
                max_leases_per_owner=settings.max_leases_per_owner,
                clock=clock,
                on_due=alarm.due,
                access=access,
                budgets=Budgets(
                    settings.max_cost_per_hour_per_owner,
                    settings.max_spend_per_day_per_owner,
                    settings.owner_budgets,
                ),
                priorities=Priorities(
                    settings.priority_table,
                    settings.owner_classes,
                    settings.unlisted_owner_max_class,
                ),
                max_waiting=settings.max_waiting_callers,
                max_waiting_per_owner=settings.waiting_per_owner,
                replica_timeout=replica_timeout,
                preemption_grace=settings.preemption_grace_seconds,
                notices=handoff,
                line_aging=settings.line_aging_seconds,
            )
            metrics.expect_classes(settings.priority_table)
            sweeper = Sweeper(service, alarm, tracing.tracer, settings.sweep_interval_seconds)
            heartbeat = Heartbeat(service, beat)
            # Always there: with WARM_POOL unset it only recycles what an earlier run left.
            pool = WarmPool(
                service,
                service.open_pool(
                    settings.warm_pools,
                    handoff,
                    max_idle_seconds=settings.warm_pool_max_idle_seconds,
                    idle_gauge=metrics.pool_idle,
                    scaledown_seconds=settings.warm_pool_scaledown_seconds,
                    max_cost_per_hour=settings.warm_pool_max_cost_per_hour,
                ),
            )
            guards = service.open_guards(
                instance=settings.scheduler_instance,
                most=settings.max_guards,
                forget_seconds=settings.guard_forget_seconds,
            )
            reconciler = Reconciler(
                service,
                tracing.tracer,
                settings.reconcile_interval_seconds,
                replica_timeout=replica_timeout,
                heartbeat=heartbeat,  # a store outage is not the other replicas' death
            )
            await heartbeat.run_once()
            app.state.service, app.state.sweeper, app.state.reconciler = (
                service,
                sweeper,
                reconciler,
            )
            reconciled = await _before_serving(service, reconciler, sweeper)
            app.state.readiness = ReadinessCheck(service, reconciler, reconciled=reconciled)
            sweeper.start()
            # The loop's first pass comes an interval after the one just made, at once
            # when that one failed.
            reconciler.start(first_wait=settings.reconcile_interval_seconds if reconciled else 0)
            heartbeat.start()
            pool.start()  # after reconciliation: what a crash left is resolved first
            admission = AdmissionLoop(service, LINE_TIMEOUT_S)
            # One replica sizes the warm pools for the cluster: the admission loop's
            # leader (the pools' demand is the cluster's, in the store).
            pool.pool.sizes = lambda: admission.leader
            admission.on_lead = pool.wake
            admission.start()
            # Deaths as the backends stream them; each stream's (re)opening wakes the
            # reconciler, whose listing finds what the stream missed.
            watcher = Watcher(service, on_resync=reconciler.wake_for)
            watcher.start()
            app.state.watcher = watcher
            # LEASE_RETENTION_DAYS=0 keeps every lease: no purge at all.
            purger = Purger(service, settings.lease_retention_days)
            if settings.lease_retention_days:
                purger.start()
            forgetter = GuardForgetter(service, guards, settings.guard_forget_seconds)
            forgetter.start()
            # Waiters here hear of capacity freed on other replicas too.
            listener = asyncio.create_task(store.listen_capacity(service.capacity_freed))
            log.info(
                "openalice-scheduler %s serving: providers=%s, store=%s",
                service_version(),
                ",".join(p.name for p in providers),
                store.backend.name,
            )
            yield
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await listener
            await watcher.stop()
            await admission.stop()
            with contextlib.suppress(SchedulerError):
                await admission.release()
            for loop in (forgetter, purger, pool, sweeper, reconciler, heartbeat):
                await loop.stop()
        finally:
            for provider in providers:
                await provider.close()
            await probe.close()
            await store.close()
            tracing.shutdown()

    return run


async def _before_serving(service: LeaseService, reconciler: Reconciler, sweeper: Sweeper) -> bool:
    """Resolve what a crash left and release what expired meanwhile, before serving.
    Whether the reconciliation finished (else the loop retries at once)."""
    try:
        await service.recover_after_restart()
        await asyncio.wait_for(reconciler.run_once(), STARTUP_RECONCILE_TIMEOUT_S)
    except (TimeoutError, SchedulerError) as exc:
        log.warning("start-up reconciliation incomplete (%s); the loop retries", type(exc).__name__)
        return False
    try:
        # Without this sweep, leases that expired while the service was down would be
        # released only once the service already answered.
        await asyncio.wait_for(sweeper.run_once(), STARTUP_RECONCILE_TIMEOUT_S)
    except (TimeoutError, SchedulerError) as exc:
        log.warning("start-up sweep incomplete (%s); the loop retries", type(exc).__name__)
    return True
