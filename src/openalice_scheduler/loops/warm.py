"""The warm pool's loop (docs/concepts/pools.md#warm-pools): woken at start, after a burst of
takes or recycles, and every few seconds, it has the pool recycle what is stale and make what
is missing (lifecycle/pooling.py).

A take wakes it once its burst is over: REFILL_AFTER_TAKE_S after the last take's hand-off
ended, and at most REFILL_AT_MOST_S after the first. Inside a burst, the pool's provisions
would compete with the hand-offs for this process's CPU (bench/warm_pool.py, paired runs:
the scheduler's own share of 16 warm acquires at once, p99 104-154 ms when it woke 0.1 s
after the first take, 94-124 ms after the burst; bench/README.md)."""

from __future__ import annotations

import asyncio

from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.lifecycle.pooling import Pool
from openalice_scheduler.loops.base import LoopService

REFILL_INTERVAL_S = 2.0
# With WARM_POOL unset there is nothing to fill: the first pass recycles what an earlier
# run left, and later ones only look (a store read) this seldom.
UNSET_INTERVAL_S = 60.0
REFILL_AFTER_TAKE_S = 0.1
REFILL_AT_MOST_S = 1.0


class WarmPool(LoopService):
    name = "warm-pool"

    def __init__(
        self, service: LeaseService, pool: Pool, interval: float = REFILL_INTERVAL_S
    ) -> None:
        super().__init__(interval if pool.plans else UNSET_INTERVAL_S)
        self.service = service
        self.pool = pool
        pool.on_taken = self.taken
        self._pending: asyncio.TimerHandle | None = None
        self._burst_began = 0.0

    def taken(self) -> None:
        """A worker was taken (its hand-off over) or recycled: wake once the burst ends."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._pending is None:
            self._burst_began = now
        else:
            self._pending.cancel()
        at = min(now + REFILL_AFTER_TAKE_S, self._burst_began + REFILL_AT_MOST_S)
        self._pending = loop.call_at(at, self._burst_over)

    def _burst_over(self) -> None:
        self._pending = None
        self.wake()

    async def run_once(self) -> dict[str, int]:
        """Recycle what is stale or surplus, then fill each target."""
        return await self.service.refill_pool()

    async def stop(self, timeout: float = 10.0) -> None:
        if self._pending is not None:
            self._pending.cancel()
        await super().stop(timeout)
        await self.pool.close()
