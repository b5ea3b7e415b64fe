"""The reconciler: one replica at a time, it lists each provider's workers and hands
the listing to the service (lifecycle/reconciling.py), which resolves crashed
provisions, destroys orphan workers and marks leases whose worker vanished `lost`."""

from __future__ import annotations

import logging

from opentelemetry.trace import Tracer

from openalice_scheduler.errors import ProviderError
from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.loops.base import LoopService
from openalice_scheduler.loops.heartbeat import Heartbeat
from openalice_scheduler.providers import Provider

# The loops' lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.loops")
RECONCILE_LOCK = "reconcile"


class Reconciler(LoopService):
    """Makes the store and the providers agree: crashed provisions are resolved,
    orphan workers destroyed, leases whose worker vanished marked `lost`."""

    name = "reconciler"

    def __init__(
        self,
        service: LeaseService,
        tracer: Tracer,
        interval: float,
        replica_timeout: float,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        super().__init__(interval)
        self.service = service
        self.tracer = tracer
        self.replica_timeout = replica_timeout
        self.heartbeat = heartbeat
        # Providers whose event stream (re)opened since the last pass (`wake_for`): the
        # next pass lists only them, unless a whole pass is due anyway.
        self._due: set[str] = set()
        self._whole_at = self.service.clock.monotonic()

    def wake_for(self, provider: str) -> None:
        """A pass over `provider` soon: its event stream (re)opened, and what the stream
        missed meanwhile is for a listing to find (loops/watcher.py)."""
        self._due.add(provider)
        self.wake()

    async def run_once(self) -> dict[str, int]:
        due, self._due = self._due, set()
        whole = not due or self.service.clock.monotonic() - self._whole_at >= self.interval
        providers = [p for p in self.service.providers if whole or p.name in due]
        totals = {"failed": 0, "orphans": 0, "lost": 0}
        store = self.service.store
        # One replica at a time: two reconcilers would race to destroy the same workers.
        lock_ttl = int(max(30.0, 3 * self.interval) * 1e6)
        gone_before = self._gone_before()
        if not await store.replicas.try_lock(
            RECONCILE_LOCK,
            ttl_us=lock_ttl,
            now=self.service.now_us(),
            holder_gone_before=gone_before,
        ):
            return totals
        try:
            with self.tracer.start_as_current_span("reconcile"):
                alive = await self._alive_replicas(gone_before)
                for provider in providers:
                    try:
                        found = await self._reconcile(provider, alive)
                    except ProviderError as exc:
                        log.warning(
                            "reconcile: %s unreachable, skipped: %s", provider.name, exc.message
                        )
                        continue
                    for key, value in found.items():
                        totals[key] += value
            # A pass that skipped an unreachable provider still ran: that provider's
            # health is scheduler_provider_up's to tell.
            self.service.metrics.reconcile_last_success.set_to_current_time()
            if whole:
                self._whole_at = self.service.clock.monotonic()
        finally:
            await store.replicas.unlock(RECONCILE_LOCK)
        if any(totals.values()):
            log.info("reconcile: %s", ", ".join(f"{k}={v}" for k, v in totals.items()))
        return totals

    def _gone_before(self) -> int | None:
        """A replica whose last heartbeat is older than this is gone. None while this
        replica cannot tell: its own heartbeats failed within the replica timeout, and a
        store outage silences every replica at once without any of them being dead."""
        if self.heartbeat is not None and not self.heartbeat.steady_for(self.replica_timeout):
            return None
        return self.service.now_us() - int(self.replica_timeout * 1e6)

    async def _alive_replicas(self, gone_before: int | None) -> set[str] | None:
        """The replicas alive now; None when every replica counts as alive."""
        if gone_before is None:
            return None
        return await self.service.store.replicas.alive(since=gone_before)

    async def _reconcile(self, provider: Provider, alive: set[str] | None) -> dict[str, int]:
        """List `provider`'s workers and hand the listing to the service. Workers first,
        leases second (the service reads them): a worker exists only after its lease
        row was written, so every worker listed has its lease among the rows read."""
        listed_at = self.service.now_us()
        workers = await provider.list_workers()
        return await self.service.reconcile(provider, workers, listed_at=listed_at, alive=alive)
