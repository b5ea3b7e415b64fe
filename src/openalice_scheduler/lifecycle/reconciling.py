"""What a provider's listing of workers means for its leases: the judgments of
reconciliation. The reconciler (loops/reconciler.py) lists, one replica at a time, and
hands each listing here; here it is decided which provisions will never finish, which
workers are orphans, and which leases lost their worker (stopped or vanished). Ending
them is ending.py's and losing.py's."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.ending import Ending
from openalice_scheduler.lifecycle.losing import MADE, VANISHED, Losing
from openalice_scheduler.models import LeaseState
from openalice_scheduler.providers import (
    ExplainingProvider,
    PartialListing,
    Provider,
    WorkerDeath,
    WorkerInfo,
)
from openalice_scheduler.store import LeaseRecord

# The reconciler's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.loops")


class Reconciling:
    def __init__(self, core: Core, ending: Ending, losing: Losing) -> None:
        self.core = core
        self.ending = ending
        self.losing = losing

    async def settle(
        self,
        provider: Provider,
        workers: Mapping[str, list[WorkerInfo]] | None,
        *,
        listed_at: int,
        alive: set[str] | None,
    ) -> dict[str, int]:
        """`workers`: `provider.list_workers()` as listed at `listed_at`, before the
        leases are read here (a worker exists only after its lease row was written, so
        every worker listed has its lease among the rows read next). `alive`: the
        replicas alive now, None when every one counts as alive."""
        store = self.core.store
        # Leases on a host that could not be listed are that host's next pass's to judge.
        unlisted = workers.unlisted if isinstance(workers, PartialListing) else frozenset()
        live = {r.lease_id: r for r in await store.live(provider.name) if r.host not in unlisted}
        counts = {
            "failed": await self._abandoned(provider, live, alive),
            "orphans": 0,
            "lost": 0,
        }
        if workers is None:
            return counts  # the provider does not make workers: none can drift
        counts["orphans"] = await self._orphans(provider, workers, live, listed_at)
        for record in live.values():
            # A lease changed since the listing (renewed, handed out) is the next pass's.
            if record.state not in MADE or record.updated_at >= listed_at:
                continue
            death = await self._death(provider, record, workers.get(record.lease_id))
            if death is not None and await self.losing.lost(provider, record, death):
                counts["lost"] += 1
        return counts

    async def _death(
        self, provider: Provider, record: LeaseRecord, infos: list[WorkerInfo] | None
    ) -> WorkerDeath | None:
        """How the lease's worker stopped, by the listing: listed as stopped, or not
        listed at all (asked of the provider when it can say: ExplainingProvider)."""
        if infos:
            # Names are not unique on some backends: the recorded worker is the one.
            held = [i for i in infos if i.provider_token == record.provider_token] or infos
            deaths = [i.death for i in held]
            return deaths[0] if all(deaths) else None
        if isinstance(provider, ExplainingProvider) and record.provider_token:
            return await provider.death_of(record.provider_token)
        return VANISHED

    async def _abandoned(
        self, provider: Provider, live: dict[str, LeaseRecord], alive: set[str] | None
    ) -> int:
        """Provisions that will never finish, recorded failed (their workers destroyed)."""
        core, store = self.core, self.core.store
        # A provision may go on while its worker is probed.
        stale_before = core.now_us() - int((core.provision_timeout + core.probe.longest) * 1e6)
        failed = 0
        # Granted by the admission loop, its caller not yet told: in flight as well.
        granted = await store.waiters.granted()
        for record in live.values():
            # `warming`: a pool worker's provision, resolved alike.
            if (
                record.state not in (LeaseState.provisioning, LeaseState.warming)
                or record.lease_id in core.in_flight
                or record.lease_id in granted
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
            if await self.ending.fail_abandoned(provider, record):
                failed += 1
        return failed

    async def _orphans(
        self,
        provider: Provider,
        workers: Mapping[str, list[WorkerInfo]],
        live: dict[str, LeaseRecord],
        listed_at: int,
    ) -> int:
        """Workers of this scheduler that no live lease holds, destroyed."""
        core, store = self.core, self.core.store
        destroyed = foreign = 0
        for lease_id, infos in workers.items():
            if lease_id in core.in_flight:
                continue
            # Workers made for another state store under the same SCHEDULER_INSTANCE are
            # that store's scheduler's to judge (unlabelled ones, from before labels, ours).
            mine = [i for i in infos if i.store_id in (None, store.store_id)]
            foreign += len(infos) - len(mine)
            # A worker its backend is already ending (a pod in its grace period) was
            # destroyed by an earlier pass or a release: not destroyed, nor counted, again.
            mine = [i for i in mine if not i.ending]
            if not mine:
                continue
            owner = live.get(lease_id)
            if owner is None:
                # A lease that ended after the listing (a sweeper, here or on another
                # replica, released it meanwhile) had its worker destroyed by that
                # release: not an orphan. Were it still there, the next pass finds it.
                ended = await store.get(lease_id)
                if ended is not None and ended.updated_at >= listed_at:
                    continue
                extra = mine  # no live lease: every worker is an orphan
            elif owner.state in MADE and owner.provider_token:
                # Names are not unique on some backends: keep only the recorded worker.
                extra = [i for i in mine if i.provider_token != owner.provider_token]
            else:
                continue
            for info in extra:
                await self.ending.destroy_orphan(provider, lease_id, info.provider_token)
                destroyed += 1
        if foreign:
            log.warning(
                "reconcile: %d worker(s) on %s carry this SCHEDULER_INSTANCE but "
                "belong to another state store; left alone (give each store its own "
                "SCHEDULER_INSTANCE)",
                foreign,
                provider.name,
            )
        return destroyed
