"""The warm pool's loop (docs/concepts/pools.md#warm-pools): woken at start, after each take or
recycle, and every few seconds, it has the pool recycle what is stale and make what is missing
(lifecycle/pooling.py)."""

from __future__ import annotations

from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.lifecycle.pooling import Pool
from openalice_scheduler.loops.base import LoopService

REFILL_INTERVAL_S = 2.0
# With WARM_POOL unset there is nothing to fill: the first pass recycles what an earlier
# run left, and later ones only look (a store read) this seldom.
UNSET_INTERVAL_S = 60.0


class WarmPool(LoopService):
    name = "warm-pool"

    def __init__(
        self, service: LeaseService, pool: Pool, interval: float = REFILL_INTERVAL_S
    ) -> None:
        super().__init__(interval if pool.plans else UNSET_INTERVAL_S)
        self.service = service
        self.pool = pool
        pool.on_taken = self.wake

    async def run_once(self) -> dict[str, int]:
        """Recycle what is stale or surplus, then fill each target."""
        return await self.service.refill_pool()

    async def stop(self, timeout: float = 10.0) -> None:
        await super().stop(timeout)
        await self.pool.close()
