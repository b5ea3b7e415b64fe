"""Background loops as small services: `run_once()` does one pass (tests call it
directly), `run()` repeats it, `stop()` ends it within a bounded time."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from opentelemetry.trace import Tracer

from openalice_scheduler.errors import ProviderError, StoreUnavailable
from openalice_scheduler.models import LeaseState
from openalice_scheduler.providers import PartialListing, Provider
from openalice_scheduler.service import LeaseService

log = logging.getLogger(__name__)
_MIN_WAIT_S = 0.005
RECONCILE_LOCK = "reconcile"
# States whose worker is made and recorded: an active lease, an idle pool worker.
_MADE = (LeaseState.active, LeaseState.idle)


class LoopService:
    name = "loop"

    def __init__(self, interval: float, *, wake: asyncio.Event | None = None) -> None:
        self.interval = interval
        self._wake = wake or asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None
        self.passes = 0  # passes of the loop that finished (readiness.py)

    async def run_once(self) -> object:
        raise NotImplementedError

    async def next_wait(self) -> float:
        return self.interval

    def start(self, *, first_wait: float = 0.0) -> None:
        """Run passes from now on; the first one after `first_wait` seconds (or a wake),
        for a loop whose pass was just run by hand."""
        self._task = asyncio.create_task(self._run(first_wait), name=self.name)

    def wake(self) -> None:
        self._wake.set()

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout)
            except TimeoutError:
                log.warning("%s did not stop within %.0f s; cancelled", self.name, timeout)
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, first_wait: float) -> None:
        if first_wait > 0:
            await self._sleep(first_wait)
        while not self._stopping:
            try:
                await self.run_once()
                self.passes += 1
                wait = await self.next_wait()
            except StoreUnavailable:
                wait = min(self.interval, 1.0)
            except Exception:
                log.exception("%s pass failed", self.name)
                wait = self.interval
            if self._stopping:
                break
            await self._sleep(wait)

    async def _sleep(self, wait: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), max(wait, _MIN_WAIT_S))
        self._wake.clear()


class Alarm:
    """When the sweeper should next look: told of every moment something becomes due
    (`due`, the service's `on_due`), it wakes the sweeper when that comes before the
    sweeper's next pass."""

    def __init__(self, now_us: Callable[[], int]) -> None:
        self.now_us = now_us
        self.event = asyncio.Event()
        self.wake_at = math.inf  # monotonic time the sweeper will next wake

    def due(self, at_us: int) -> None:
        if time.monotonic() + (at_us - self.now_us()) / 1e6 < self.wake_at:
            self.event.set()


class Sweeper(LoopService):
    """Has the service release expired leases and retry failed releases. Wakes at the
    next known expiry or retry, so expiry never waits for a whole interval."""

    name = "sweeper"

    def __init__(
        self, service: LeaseService, alarm: Alarm, tracer: Tracer, interval: float
    ) -> None:
        super().__init__(interval, wake=alarm.event)
        self.service = service
        self.alarm = alarm
        self.tracer = tracer

    async def run_once(self) -> int:
        with self.tracer.start_as_current_span("sweep") as span:
            released = await self.service.release_due()
            span.set_attribute("leases", released)
        self.service.metrics.sweep_last_success.set_to_current_time()
        return released

    async def next_wait(self) -> float:
        # While the next due time is being read, any `due` must wake the loop: a lease
        # activated after the read but before `wake_at` is set below was otherwise
        # compared with the stale (past) `wake_at`, ignored, and left to wait a whole
        # interval past its expiry.
        self.alarm.wake_at = math.inf
        due = await self.service.store.next_due()
        wait = self.interval
        if due is not None:
            wait = min(wait, max(0.0, (due - self.service.now_us()) / 1e6))
        self.alarm.wake_at = time.monotonic() + wait
        return wait


class Reconciler(LoopService):
    """Makes the store and the providers agree: crashed provisions are resolved,
    orphan workers destroyed, leases whose worker vanished marked `lost`."""

    name = "reconciler"

    def __init__(
        self,
        service: LeaseService,
        tracer: Tracer,
        interval: float,
        provision_timeout: float,
        replica_timeout: float,
        heartbeat: Heartbeat | None = None,
    ) -> None:
        super().__init__(interval)
        self.service = service
        self.tracer = tracer
        self.provision_timeout = provision_timeout
        self.replica_timeout = replica_timeout
        self.heartbeat = heartbeat

    async def run_once(self) -> dict[str, int]:
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
                for provider in self.service.providers:
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
        service, store = self.service, self.service.store
        # Workers first, leases second: a worker exists only after its lease row was
        # written, so every worker listed here has its lease among the rows read next.
        listed_at = service.now_us()
        workers = await provider.list_workers()
        # Leases on a host that could not be listed are that host's next pass's to judge.
        unlisted = workers.unlisted if isinstance(workers, PartialListing) else frozenset()
        live = {r.lease_id: r for r in await store.live(provider.name) if r.host not in unlisted}
        stale_before = service.now_us() - int(self.provision_timeout * 1e6)
        counts = {"failed": 0, "orphans": 0, "lost": 0}

        for record in live.values():
            # `warming`: a pool worker's provision, resolved alike.
            if (
                record.state not in (LeaseState.provisioning, LeaseState.warming)
                or record.lease_id in service.in_flight
            ):
                continue
            # A provision whose replica stopped (crashed, killed) will never finish.
            crashed = (
                record.replica_id != store.replica_id
                and alive is not None
                and record.replica_id not in alive
            )
            # This replica's own row, no longer in flight: its acquire ended without
            # resolving it (the store failed under it, e.g. while recording `active`).
            abandoned = record.replica_id == store.replica_id
            if not (crashed or abandoned or record.updated_at < stale_before):
                continue
            if await service.fail_abandoned(provider, record):
                counts["failed"] += 1

        if workers is None:
            return counts  # the provider does not make workers: none can drift
        foreign = 0
        for lease_id, infos in workers.items():
            if lease_id in service.in_flight:
                continue
            # Workers made for another state store under the same SCHEDULER_INSTANCE are
            # that store's scheduler's to judge (unlabelled ones, from before labels, ours).
            mine = [i for i in infos if i.store_id in (None, store.store_id)]
            foreign += len(infos) - len(mine)
            if not mine:
                continue
            infos = mine
            owner = live.get(lease_id)
            if owner is None:
                # A lease that ended after the listing (a sweeper, here or on another
                # replica, released it meanwhile) had its worker destroyed by that
                # release: not an orphan. Were it still there, the next pass finds it.
                ended = await store.get(lease_id)
                if ended is not None and ended.updated_at >= listed_at:
                    continue
                extra = infos  # no live lease: every worker is an orphan
            elif owner.state in _MADE and owner.provider_token:
                # Names are not unique on some backends: keep only the recorded worker.
                extra = [i for i in infos if i.provider_token != owner.provider_token]
            else:
                continue
            for info in extra:
                await service.destroy_orphan(provider, lease_id, info.provider_token)
                counts["orphans"] += 1
        if foreign:
            log.warning(
                "reconcile: %d worker(s) on %s carry this SCHEDULER_INSTANCE but "
                "belong to another state store; left alone (give each store its own "
                "SCHEDULER_INSTANCE)",
                foreign,
                provider.name,
            )

        for record in live.values():
            vanished = record.lease_id not in workers
            if (
                record.state in _MADE
                and vanished
                and record.updated_at < listed_at
                and await service.mark_lost(provider, record)
            ):
                counts["lost"] += 1
        return counts


class Heartbeat(LoopService):
    """Tells the other replicas this one is alive, so that they resolve its provisions
    only once it stops."""

    name = "heartbeat"

    def __init__(self, service: LeaseService, interval: float) -> None:
        super().__init__(interval)
        self.service = service
        self._failed_at: float | None = None  # monotonic time of the last failed beat

    async def run_once(self) -> None:
        try:
            await self.service.store.replicas.heartbeat(now=self.service.now_us())
        except StoreUnavailable:
            self._failed_at = time.monotonic()
            raise

    def steady_for(self, seconds: float) -> bool:
        """No heartbeat of this replica failed in the last `seconds`: had another
        replica stopped beating meanwhile, it was not for a store outage."""
        return self._failed_at is None or time.monotonic() - self._failed_at >= seconds
