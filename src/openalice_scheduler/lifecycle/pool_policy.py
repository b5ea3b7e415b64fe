"""How many idle workers a warm pool that follows demand keeps (issue 37; the pool's loop
does not apply it yet: WARM_POOL's targets are fixed until it does): a pure function of
the demand seen and the time, passed in, so that it runs the same in the service, in
tests on a moved clock and in a day-long simulation.

The rule follows Knative's autoscaler: demand is the pool's acquires per second over a
stable window (60 s) and over a panic window (6 s). The pool keeps enough idle workers
for the acquires expected while one worker starts cold (rate × cold start), plus its
`buffer`, within `min` and `max`:

- a jump (the panic window's rate at least twice the stable one, from three acquires
  on) raises the target at once, from the panic rate;
- a lull lowers it only after the scale-down window: the target is the highest one
  computed over the last `scaledown_s`, so a short gap between bursts keeps the pool;
- with `min` 0 and no acquire within the scale-down window the target is 0 (buffer
  included): the pool empties, and the next acquire goes cold and fills it again."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

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


@dataclass
class Demand:
    """The acquires one pool saw (their times, seconds on the caller's monotonic clock),
    and the targets it computed (for the scale-down window)."""

    acquires: deque[float] = field(default_factory=deque)
    targets: deque[tuple[float, int]] = field(default_factory=deque)

    def saw(self, at: float) -> None:
        self.acquires.append(at)

    def rate(self, now: float, window: float) -> float:
        """Acquires per second over the last `window` seconds."""
        return sum(1 for t in self.acquires if now - window <= t <= now) / window

    def last_acquire(self) -> float | None:
        return self.acquires[-1] if self.acquires else None

    def forget_before(self, at: float) -> None:
        while self.acquires and self.acquires[0] < at:
            self.acquires.popleft()
        while self.targets and self.targets[0][0] < at:
            self.targets.popleft()


def target(shape: PoolShape, demand: Demand, now: float, cold_start_s: float) -> int:
    """The idle workers the pool should keep at `now`, and the decision remembered in
    `demand` (for the scale-down window)."""
    keep = max(shape.scaledown_s, STABLE_S)
    demand.forget_before(now - keep)
    last = demand.last_acquire()
    if shape.min == shape.max:
        wanted = shape.min
    elif last is None or now - last > shape.scaledown_s:
        wanted = shape.min  # no demand for a whole window: down to min (0: empty)
    else:
        stable = demand.rate(now, STABLE_S)
        panic = demand.rate(now, PANIC_S)
        jump = panic >= PANIC_RATIO * stable and panic * PANIC_S >= PANIC_MIN
        rate = panic if jump else stable
        expected = math.ceil(rate * cold_start_s - 1e-9)
        computed = min(shape.max, max(shape.min, expected + shape.buffer))
        demand.targets.append((now, computed))
        recent = [t for at, t in demand.targets if now - at <= shape.scaledown_s]
        wanted = max(recent)
    return min(shape.max, max(shape.min, wanted))
