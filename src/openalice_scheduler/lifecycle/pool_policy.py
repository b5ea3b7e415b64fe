"""How many idle workers a warm pool that follows demand keeps
(docs/concepts/pools.md#pools-that-follow-demand): a pure function of the acquires seen and
the time, passed in, so that it runs the same in the service (whose pool loop reads the
acquires from the store: every replica, and a restarted one, sees the same demand), in
tests on a moved clock and in a day-long simulation.

The rule follows Knative's autoscaler: demand is the pool's acquires per second over a
stable window (60 s) and over a panic window (6 s). The pool keeps enough idle workers
for the acquires expected while one worker starts cold (rate × cold start), plus its
`buffer`, within `min` and `max`:

- a jump (the panic window's rate at least twice the stable one, from three acquires
  on) raises the target at once, from the panic rate;
- a lull lowers it only after the scale-down window: the target is the highest one
  computed over the last `scaledown_s` (at each acquire within it, where the rates peak:
  nothing is remembered but the acquires), so a short gap between bursts keeps the pool;
- with `min` 0 and no acquire within the scale-down window the target is 0 (buffer
  included): the pool empties, and the next acquire goes cold and fills it again."""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

K = TypeVar("K", bound=Hashable)

STABLE_S = 60.0
PANIC_S = 6.0
# The panic window's rate, against the stable one, that makes a jump; and the acquires
# it must hold at least (one acquire in 6 s is chance, not a jump).
PANIC_RATIO = 2.0
PANIC_MIN = 3


@dataclass(frozen=True, slots=True)
class PoolShape:
    """A pool's bounds: idle workers kept at least (`min`) and at most (`max`), beyond
    the expected demand (`buffer`), and how long a lull lasts before the pool shrinks."""

    min: int
    max: int
    buffer: int = 0
    scaledown_s: float = 300.0

    @classmethod
    def fixed(cls, n: int) -> PoolShape:
        """`WARM_POOL=kind/gpu=N`: N idle workers, whatever the demand."""
        return cls(min=n, max=n)

    @property
    def follows(self) -> bool:
        """Whether the demand moves the target (min < max)."""
        return self.min < self.max

    def history_s(self) -> float:
        """How far back `target` looks at acquires."""
        return max(self.scaledown_s, 0.0) + STABLE_S


@dataclass
class Demand:
    """The acquires one pool saw: their times in seconds, ascending (the service reads
    them from the store; the simulation adds them as they come)."""

    acquires: list[float] = field(default_factory=list)

    def saw(self, at: float) -> None:
        bisect.insort(self.acquires, at)

    def count(self, start: float, end: float) -> int:
        """Acquires within (start, end]: a window's length, never one acquire more."""
        return bisect.bisect_right(self.acquires, end) - bisect.bisect_right(self.acquires, start)

    def last_acquire(self, now: float) -> float | None:
        """The last acquire at or before `now`."""
        i = bisect.bisect_right(self.acquires, now)
        return self.acquires[i - 1] if i else None


def expected(demand: Demand, at: float, cold_start_s: float) -> int:
    """The acquires expected while one worker starts cold, from the rates at `at`: the
    stable window's, or the panic window's in a jump."""
    stable = demand.count(at - STABLE_S, at) / STABLE_S
    panic_count = demand.count(at - PANIC_S, at)
    panic = panic_count / PANIC_S
    jump = panic >= PANIC_RATIO * stable and panic_count >= PANIC_MIN
    return math.ceil((panic if jump else stable) * cold_start_s - 1e-9)


def target(shape: PoolShape, demand: Demand, now: float, cold_start_s: float) -> int:
    """The idle workers the pool should keep at `now`."""
    if not shape.follows:
        return shape.min
    last = demand.last_acquire(now)
    if last is None or now - last > shape.scaledown_s:
        return shape.min  # no demand for a whole window: down to min (0: empty)
    # The highest need over the scale-down window: at `now`, or just after an acquire
    # within it (a window's count only grows at an acquire).
    start = bisect.bisect_left(demand.acquires, now - shape.scaledown_s)
    end = bisect.bisect_right(demand.acquires, now)
    need = max(expected(demand, at, cold_start_s) for at in [now, *demand.acquires[start:end]])
    return min(shape.max, max(shape.min, need + shape.buffer))


def afforded(
    wanted: Mapping[K, int],
    prices: Mapping[K, float],
    caps: Mapping[K, float | None],
    total_cap: float | None,
    order: Sequence[K],
) -> dict[K, int]:
    """`wanted` within each pool's cap (`caps`, $/h) and all pools' together
    (`total_cap`), at each pool's price per worker (`prices`; a pool missing there is not
    priced yet). Pools take from the total in `order`. A capped pool not priced yet keeps
    at most one worker: its reservation tells the price."""
    left = total_cap
    kept: dict[K, int] = {}
    for key in order:
        n = wanted[key]
        bounds = [c for c in (caps.get(key), left) if c is not None]
        price = prices.get(key)
        if bounds and price is None:
            n = min(n, 1)
        elif bounds and price:
            n = min(n, math.floor(min(bounds) / price + 1e-9))
        kept[key] = n
        if left is not None:
            left = max(0.0, left - n * (price or 0.0))
    return kept
