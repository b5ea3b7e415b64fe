"""How many workers each warm pool keeps now (docs/concepts/pools.md#pools-that-follow-demand):
the policy (pool_policy.py) applied to the demand the store holds, then the money caps.

The demand is every replica's: the requests of the pool's kind, GPU class and priority
classes over the last minutes, read from the store on each pass, so a replica behind a
balancer sees the whole cluster's and a restarted one its history. The cold start the
policy covers is this replica's own measure of its pool workers' starts (from reserve to
ready, a moving average); until one was made, COLD_START_GUESS_S.

Money: a pool's `max_cost` ($/h) and WARM_POOL_MAX_COST_PER_HOUR bound the workers kept
at the price a worker of the pool costs (its provider's quote at its last reservation).
Under the global cap, pools serving the highest classes keep theirs first; pools for any
class come after those for named classes. Until a pool's price is known, a capped pool
keeps at most one worker (whose reservation tells the price)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from openalice_scheduler.config import PoolEntry
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.pool_policy import Demand, PoolShape, target
from openalice_scheduler.store.pool import PoolStore

Key = tuple[str, str]  # (kind, gpu)

# The cold start assumed before this replica has made one of the pool's workers.
COLD_START_GUESS_S = 30.0
# Weight of the newest measured start in the moving average.
COLD_START_WEIGHT = 0.3


@dataclass(frozen=True, slots=True)
class Plan:
    """One pool as declared: its shape, the classes it serves (None: any) and its cap."""

    shape: PoolShape
    classes: frozenset[str] | None = None
    max_cost: float | None = None

    @classmethod
    def of(cls, entry: PoolEntry, scaledown_s: float) -> Plan:
        shape = PoolShape(entry.min, entry.max, entry.buffer, scaledown_s)
        return cls(shape, entry.classes, entry.max_cost)

    def serves_class(self, priority_class: str) -> bool:
        return self.classes is None or priority_class in self.classes


class Sizing:
    def __init__(
        self,
        core: Core,
        store: PoolStore,
        plans: Mapping[Key, Plan],
        *,
        max_cost_per_hour: float | None,
    ) -> None:
        self.core = core
        self.store = store
        self.plans = dict(plans)
        self.max_cost_per_hour = max_cost_per_hour
        self.cold_start_s: dict[Key, float] = {}
        self.price: dict[Key, float] = {}

    def started(self, key: Key, seconds: float) -> None:
        """A pool worker of `key` went from reserved to ready in `seconds`."""
        before = self.cold_start_s.get(key)
        self.cold_start_s[key] = (
            seconds if before is None else before + COLD_START_WEIGHT * (seconds - before)
        )

    def priced(self, key: Key, price: float | None) -> None:
        """A pool worker of `key` was reserved at `price` $/h (None: unknown)."""
        if price is not None:
            self.price[key] = price

    async def targets(self) -> dict[Key, int]:
        """Each pool's workers to keep (idle and warming) now."""
        now_us = self.core.now_us()
        demands = {key: Demand() for key in self.plans}
        follows = [plan.shape for plan in self.plans.values() if plan.shape.follows]
        if follows:
            since = now_us - int(max(shape.history_s() for shape in follows) * 1e6)
            for acquire in await self.store.acquires(since):  # in order of time
                key = (acquire.kind, acquire.gpu)
                plan = self.plans.get(key)
                if plan is not None and plan.serves_class(acquire.priority_class):
                    demands[key].acquires.append(acquire.requested_at / 1e6)
        now = now_us / 1e6
        wanted = {
            key: target(
                plan.shape,
                demands[key],
                now,
                self.cold_start_s.get(key, COLD_START_GUESS_S),
            )
            for key, plan in self.plans.items()
        }
        return self._afforded(wanted)

    def _afforded(self, wanted: dict[Key, int]) -> dict[Key, int]:
        """`wanted` within each pool's `max_cost` and the global cap."""
        left = self.max_cost_per_hour
        kept: dict[Key, int] = {}
        for key in sorted(wanted, key=self._precedence):
            n = wanted[key]
            plan = self.plans[key]
            caps = [c for c in (plan.max_cost, left) if c is not None]
            price = self.price.get(key)
            if caps and price is None:
                n = min(n, 1)  # its reservation tells the price
            elif caps and price:
                n = min(n, math.floor(min(caps) / price + 1e-9))
            kept[key] = n
            if left is not None:
                left = max(0.0, left - n * (price or 0.0))
        return kept

    def _precedence(self, key: Key) -> tuple[int, int, Key]:
        """Pools for the highest classes first; those for any class after the others."""
        classes = self.plans[key].classes
        if classes is None:
            return (1, 0, key)
        lowest_first = self.core.priorities.rank()
        best = max((lowest_first.index(n) for n in classes if n in lowest_first), default=0)
        return (0, -best, key)
