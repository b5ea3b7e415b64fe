"""How many workers each warm pool keeps now (docs/concepts/pools.md#pools-that-follow-demand):
the policy (pool_policy.py) applied to the demand the store holds, then the money caps.

The demand is every replica's: the requests of the pool's kind, GPU class and priority
classes over the last minutes, read from the store on each pass, so a replica behind a
balancer sees the whole cluster's and a restarted one its history. The cold start the
policy covers is the median of the pool's recent workers' starts (reserved to ready, the
last COLD_STARTS_KEPT within COLD_STARTS_S, from the store: the same on every replica);
until one was made, COLD_START_GUESS_S.

Money: a pool's `max_cost` ($/h) and WARM_POOL_MAX_COST_PER_HOUR bound the workers kept
at the price a worker of the pool costs (its provider's quote at its last reservation).
Under the global cap, pools serving the highest classes keep theirs first; pools for any
class come after those for named classes. Until a pool's price is known, a capped pool
keeps at most one worker (whose reservation tells the price)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from openalice_scheduler.config import PoolEntry
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.lifecycle.pool_policy import Demand, PoolShape, afforded, target
from openalice_scheduler.models import LeaseState
from openalice_scheduler.store.pool import Acquire, PoolStore
from openalice_scheduler.times import HOUR_US

Key = tuple[str, str]  # (kind, gpu)

# The cold start assumed before any of the pool's workers was made.
COLD_START_GUESS_S = 30.0
# A pool's cold start: the median of its last this many workers' starts within this long.
COLD_STARTS_KEPT = 20
COLD_STARTS_S = 86_400.0


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

    async def _learn_starts(self, now_us: int) -> None:
        """Each pool's cold start, from its recent workers' starts in the store."""
        since = now_us - int(COLD_STARTS_S * 1e6)
        learned: dict[Key, float] = {}
        for kind, gpu in self.plans:
            took = await self.store.starts(kind, gpu, since, COLD_STARTS_KEPT)
            if took:
                learned[(kind, gpu)] = statistics.median(took) / 1e6
        self.cold_start_s = learned

    def priced(self, key: Key, price: float | None) -> None:
        """A pool worker of `key` was reserved at `price` $/h (None: unknown)."""
        if price is not None:
            self.price[key] = price

    async def targets(self) -> dict[Key, int]:
        """Each pool's workers to keep (idle and warming) now."""
        now_us = self.core.now_us()
        follows = [plan.shape for plan in self.plans.values() if plan.shape.follows]
        if not follows:
            return self._sized({}, now_us)
        await self._learn_starts(now_us)
        since = now_us - int(max(shape.history_s() for shape in follows) * 1e6)
        return self._sized(self._by_pool(await self.store.acquires(since)), now_us)

    async def view(self) -> list[dict[str, Any]]:
        """Each pool as `GET /v1/pools` shows it: its declaration, its target now, its
        workers, what they cost an hour, and its hits and misses over the last hour."""
        now_us = self.core.now_us()
        history = max((p.shape.history_s() for p in self.plans.values()), default=0.0)
        since = now_us - max(HOUR_US, int(history * 1e6))
        mine = self._by_pool(await self.store.acquires(since))
        await self._learn_starts(now_us)
        targets = self._sized(mine, now_us)
        workers: dict[tuple[Key, str], int] = {}
        for count in await self.store.counts():
            at = ((count.kind, count.gpu), count.state)
            workers[at] = workers.get(at, 0) + count.count
        shown = []
        for key, plan in self.plans.items():
            hour = [a for a in mine.get(key, []) if a.requested_at >= now_us - HOUR_US]
            idle = workers.get((key, LeaseState.idle), 0)
            warming = workers.get((key, LeaseState.warming), 0)
            price = self.price.get(key)
            shown.append(
                {
                    "kind": key[0],
                    "gpu": key[1],
                    "classes": None if plan.classes is None else sorted(plan.classes),
                    "min": plan.shape.min,
                    "max": plan.shape.max,
                    "buffer": plan.shape.buffer,
                    "max_cost": plan.max_cost,
                    "target": targets[key],
                    "cold_start_seconds": self.cold_start_s.get(key),
                    "idle": idle,
                    "warming": warming,
                    "price_per_hour": price,
                    "cost_per_hour": None if price is None else (idle + warming) * price,
                    "hits_last_hour": sum(1 for a in hour if a.pooled),
                    "misses_last_hour": sum(1 for a in hour if not a.pooled),
                }
            )
        return shown

    def _by_pool(self, acquires: list[Acquire]) -> dict[Key, list[Acquire]]:
        """The requests each pool serves (its kind, GPU class and classes), in order."""
        mine: dict[Key, list[Acquire]] = {}
        for acquire in acquires:
            key = (acquire.kind, acquire.gpu)
            plan = self.plans.get(key)
            if plan is not None and plan.serves_class(acquire.priority_class):
                mine.setdefault(key, []).append(acquire)
        return mine

    def _sized(self, mine: dict[Key, list[Acquire]], now_us: int) -> dict[Key, int]:
        demands = {
            key: Demand([a.requested_at / 1e6 for a in mine.get(key, [])]) for key in self.plans
        }
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
        return afforded(
            wanted,
            self.price,
            {key: plan.max_cost for key, plan in self.plans.items()},
            self.max_cost_per_hour,
            sorted(wanted, key=self._precedence),
        )

    def _precedence(self, key: Key) -> tuple[int, int, Key]:
        """Pools for the highest classes first; those for any class after the others."""
        classes = self.plans[key].classes
        if classes is None:
            return (1, 0, key)
        lowest_first = self.core.priorities.rank()
        best = max((lowest_first.index(n) for n in classes if n in lowest_first), default=0)
        return (0, -best, key)
