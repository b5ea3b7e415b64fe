"""A worker that stopped after its hand-out
(docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out): its lease ends at once,
`released` with reason `lost` and the cause its backend gave (an idle pool worker is `recycled` for
it, and replaced), its room is free for the next caller, and what remains of the worker (a stopped
container, a failed pod) is destroyed.

Deaths come from two places, and both end here: a backend's event stream (the Docker
engine's events, the Kubernetes pod watch, the static endpoints' probes), heard by the
watcher loop, and the reconciler's listing (a worker listed as stopped, or no longer
listed at all). The end is one guarded move (`LOSE`, from a state whose worker was
handed out): of two replicas hearing one death, or a death racing a renewal, a release
or an expiry, only one moves the lease; the others find it moved and do nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from openalice_scheduler.errors import SchedulerError
from openalice_scheduler.lifecycle import states
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.making import destroy_quietly
from openalice_scheduler.lifecycle.watching import Watching
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.models import LeaseState, LostCause, ReleaseReason
from openalice_scheduler.providers import Provider, WorkerDeath, WorkerEnded
from openalice_scheduler.store import LeaseRecord

# The service's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.service")
# States whose worker was made and handed out (or is idle in the pool): `LOSE`'s sources.
MADE = states.LOSE.sources
# How often a death heard during its worker's hand-out looks whether the hand-out is done.
IN_FLIGHT_POLL_S = 0.05
# What a worker that vanished from its backend's listing died of, when nothing says more.
VANISHED = WorkerDeath(LostCause.unknown, None, "the worker is no longer on its backend")


class Losing:
    def __init__(self, core: Core, watching: Watching) -> None:
        self.core = core
        self.watching = watching  # told of each lease this ends
        # Called when an idle pool worker was lost: the pool makes its replacement.
        self.pool_lost: Callable[[], None] = lambda: None
        self._later: set[asyncio.Task[None]] = set()  # deaths judged after a hand-out

    async def heard(self, provider: Provider, ended: WorkerEnded) -> bool:
        """A death heard from `provider`'s event stream: the lease of that worker ends,
        if the worker is the one its lease holds and the lease still holds it. Whether
        this call ended it. A worker that dies while this process still hands it out
        (probed, recorded, handed off) is judged again once that is done."""
        record = await self._holder(provider, ended)
        if record is None:
            if ended.lease_id in self.core.in_flight:
                task = asyncio.create_task(self._after_hand_out(provider, ended))
                self._later.add(task)
                task.add_done_callback(self._later.discard)
            return False
        return await self.lost(provider, record, ended.death)

    async def _after_hand_out(self, provider: Provider, ended: WorkerEnded) -> None:
        core = self.core
        deadline = core.clock.monotonic() + core.provision_timeout + core.probe.longest
        while ended.lease_id in core.in_flight and core.clock.monotonic() < deadline:
            await asyncio.sleep(IN_FLIGHT_POLL_S)
        with contextlib.suppress(SchedulerError):  # the reconciler's listing, then
            record = await self._holder(provider, ended)
            if record is not None:
                await self.lost(provider, record, ended.death)

    async def lost(self, provider: Provider, record: LeaseRecord, death: WorkerDeath) -> bool:
        """`record`'s worker stopped for good, as `death` says: the lease ends (if it
        still holds the worker) and the remains are destroyed. Whether this call ended
        it. A lease whose expiry has passed ends `expired` instead: its worker gone is
        that expiry enforced (by a guard while no scheduler ran,
        docs/concepts/guard.md#the-guard)."""
        core = self.core
        now = core.now_us()
        expired = record.state == LeaseState.active and record.expires_at <= now
        idle = record.state == LeaseState.idle
        reason = (
            ReleaseReason.expired
            if expired
            else ReleaseReason.recycled
            if idle
            else ReleaseReason.lost
        )
        ended = await core.store.mark_lost(
            record.lease_id,
            states.LOSE,
            now=now,
            reason=reason,
            cause=None if expired else death.cause.value,
            exit_code=None if expired else death.exit_code,
        )
        if ended is None:
            return False  # ended (or moved) meanwhile, by whoever came first
        self.watching.changed(record.lease_id)
        core.capacity_freed()
        core.metrics.released.labels(provider.name, reason.value).inc()
        core.metrics.spent(ended)
        if expired:
            log.info(
                "lease %s: expired, and its worker already gone from %s; released",
                lease_ref(record),
                provider.name,
            )
        else:
            core.metrics.workers_lost.labels(provider.name, death.cause.value).inc()
            log.warning(
                "%s %s: its worker on %s stopped (%s%s): %s",
                "pool worker" if idle else "lease",
                lease_ref(record),
                provider.name,
                death.cause.value,
                "" if death.exit_code is None else f", exit code {death.exit_code}",
                f"recycled; {death.detail}" if idle else f"lost; {death.detail}",
            )
        # What remains of it (a stopped container, a failed pod, an ended sandbox): one
        # the provider cannot destroy now is an orphan for the reconciler.
        await destroy_quietly(provider, record.lease_id, record.provider_token)
        if idle:
            self.pool_lost()
        return True

    async def _holder(self, provider: Provider, ended: WorkerEnded) -> LeaseRecord | None:
        """The lease whose worker is the one that died, if it still holds it."""
        if ended.lease_id is not None:
            record = await self.core.store.get(ended.lease_id)
            found = [] if record is None else [record]
        else:  # a backend that does not label its workers (static endpoints): by token
            found = await self.core.store.live(provider.name)
        for record in found:
            if (
                record.provider == provider.name
                and record.provider_token == ended.provider_token
                and record.state in MADE
            ):
                return record
        return None
