#!/usr/bin/env python
"""A warm pool that follows demand, replayed over a day on a virtual clock (issue 37).

The pool's policy is the service's own code (`lifecycle/pool_policy.py`: `target`,
`PoolShape`, `Demand`), run here on simulated seconds: no service, no worker, no sleep.
Each second, and at each acquire, the pool's refill asks `target(shape, demand, now,
cold_start)` and starts cold workers until idle + warming reach it (each is ready one
cold start later), and destroys idle workers beyond it (a warming one is left to finish).
An acquire of the pool's class takes an idle worker if there is one (a hit, wait 0: the
hand-off itself is left out) or starts its own worker cold (a miss, wait one cold start);
either way it counts as an acquire in the pool's demand. A leased worker never returns to
the pool (as in the service: a warm worker serves one lease); it ends with its session.

The pool serves `live` only (issue 37's pools per priority class): the anim batches in the
traces go to their own workers cold and neither take pool workers nor count in its demand.

Cold starts, seconds from create to a worker that answers (our figures, per backend):
  docker      0.5  a local container of a cached image: `bench/acquire_release.py` measures
                   ~0.66 s for `docker run -d` + probe + `docker rm -f` on this host.
  modal       2    a sandbox of a cached image is scheduled and booted in about a second or
                   two; readiness adds the worker's own start
                   (https://modal.com/docs/guide/cold-start,
                   https://modal.com/blog/unpacking-sandbox-startup-latency).
  runpod      90   a pod is RUNNING after its image pull and GPU start: "30-120 seconds" for
                   a cold GPU pod (https://theneuralbase.com/runpod/learn/beginner/endpoint-cold-start-timeouts/);
                   the middle of that range.
  kubernetes  240  a GPU node added by the autoscaler, joined, the image pulled: "a pod
                   requiring a new node (via Karpenter): ~5 minutes"
                   (https://sbhn.g1b.me/item/44053826); the cluster autoscaler waits up to
                   `max-node-provision-time` (15 min by default,
                   https://github.com/kubernetes/autoscaler/blob/master/cluster-autoscaler/FAQ.md).
                   4 minutes: a node that comes in the usual time, not the worst.

Prices, USD per hour of a worker of GPU class `entry` (live-control's renderer): the
project's defaults where it has one (MODAL_PRICE_PER_HOUR: entry=0.86, config/modal.py;
LOCAL_DOCKER_ and K8S_PRICE_PER_HOUR default to 0: a host the operator already pays for);
RunPod's price is its live catalog's, so ours is 0.69 (an RTX 4090 in the secure cloud, the
RunPod emulator's list figure). A second cost column puts every backend at 0.86 $/h.

Two traces, seeded (`--seed`):
  day    a working day: a quiet night (a few sessions), a morning rush (peak ~09:30), a
         lull at lunch, an afternoon peak (~15:00), an evening tail; live-control sessions
         of 3 to 60 minutes (log-normal, median 12); three anim batches of 40-120 acquires
         at once; and a 10x jump at 11:00 (ten times the rate of the hour, for 20 minutes).
  flat   a 24 h service at a flat rate with noise (the rate redrawn every 10 minutes,
         x0.3..x2), short spikes (x4 for 2 minutes, ~one every 2 h), and its own 10x jump
         at 03:00 (from the flat rate, for 20 minutes); same sessions.

Pools compared on the same acquires, per backend:
  follow   PoolShape(min=0, max=60, buffer=1, scaledown_s=300): the service's defaults
           for a pool that follows demand, not tuned to these traces.
  peak     PoolShape.fixed(n): n = the most live acquires within one cold start over the
           trace, the jump left out (an operator sizes for the peak he knows of).
  mean     PoolShape.fixed(n): n = the mean live acquires per cold start over the hours
           that have any, rounded up.
With --what-if, two more beside `follow`:
  what-if  NOT the service's policy: `follow` sized for the 99th percentile of the
           acquires of one cold start instead of their mean (see `what_if`).
  min=1    `follow` with min 1: the service's policy, a pool that never empties.
Every pool starts empty at 00:00 (the service fills it at start as well).

Figures: `hits` the share of live acquires served warm; `lull/jump/rest` the misses after
no live acquire for the scale-down window, within the jump, and the others (the pool
drained); `p50/p99` the wait (s); `idle h` the worker-hours of ready pool workers not
leased and `/leased` against the hours of live sessions; `warm h` those of pool workers
booting (paid as well); `$` idle + booting at the price above, `$@0.86` at 0.86 $/h;
`jump→95%` the seconds from the jump until the hit ratio over the trailing 30 s (of
acquires, taken at each acquire) is >= 95 % for the rest of the jump (0: it never fell
under); `last miss` the jump's last cold acquire (the rolling figure lags it by up to
30 s); `empty` the seconds from the trace's last live acquire until the pool has no
worker. Goals (RunPod, `day`): hits >= 99 %, idle h <= 15 % of leased h, jump→95% <= cold
start + 30 s, empty <= scale-down window + 30 s.

    .venv/bin/python bench/pool_sim.py [--seed 37] [--what-if]
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from openalice_scheduler.lifecycle.pool_policy import Demand, PoolShape, target  # noqa: E402

HOUR = 3600.0
DAY = 24 * HOUR
COLD_S = {"docker": 0.5, "modal": 2.0, "runpod": 90.0, "kubernetes": 240.0}
PRICE = {"docker": 0.0, "modal": 0.86, "runpod": 0.69, "kubernetes": 0.0}
REFERENCE_PRICE = 0.86
FOLLOW = PoolShape(min=0, max=60, buffer=1, scaledown_s=300.0)
FOLLOW_MIN1 = PoolShape(min=1, max=60, buffer=1, scaledown_s=300.0)
JUMP_LEN_S = 20 * 60.0
ROLLING_S = 30.0
ROLLING_GOAL = 0.95
MISS_SHARE = 0.01  # the what-if's aim: at most 1 % of acquires find the pool drained

Policy = Callable[[PoolShape, Demand, float, float], int]


def covering(expected: int) -> int:
    """The fewest workers that a Poisson count of mean `expected` exceeds (reaches) with
    probability <= MISS_SHARE: the acquires of one cold start that drain a pool of that
    size are that rare."""
    if expected <= 0:
        return 0
    n, term = 0, math.exp(-expected)
    cdf = term
    while 1.0 - cdf > MISS_SHARE:  # P(X >= n + 1) = 1 - P(X <= n)
        n += 1
        term *= expected / n
        cdf += term
    return n + 1


def what_if(shape: PoolShape, demand: Demand, now: float, cold_s: float) -> int:
    """NOT the service's policy: the proposal this bench measures beside it. The service's
    own target without the buffer gives the acquires expected in one cold start (its
    windows, jump and scale-down rules unchanged); the pool keeps enough for the 99th
    percentile of a Poisson count of that mean, plus the buffer."""
    last = demand.last_acquire(now)
    expected = target(PoolShape(shape.min, shape.max, 0, shape.scaledown_s), demand, now, cold_s)
    if shape.min == shape.max or last is None or now - last > shape.scaledown_s:
        return expected  # fixed, or no demand in the window: as the service
    return min(shape.max, max(shape.min, covering(expected) + shape.buffer))


@dataclass(frozen=True, slots=True)
class Acquire:
    at: float
    cls: str  # "live" or "anim"
    session_s: float


@dataclass
class Trace:
    name: str
    acquires: list[Acquire]
    jump_at: float
    end: float


def session_s(rng: random.Random) -> float:
    """A live-control session: log-normal, median 12 minutes, within 3 and 60."""
    return min(3600.0, max(180.0, rng.lognormvariate(math.log(720.0), 0.7)))


def poisson_arrivals(
    rng: random.Random, rate_at: Callable[[float], float], start: float, end: float, peak: float
) -> Iterator[float]:
    """Arrivals of a Poisson process of rate `rate_at(t)` (per second, <= `peak`), by
    thinning."""
    at = start
    while True:
        at += rng.expovariate(peak)
        if at >= end:
            return
        if rng.random() * peak < rate_at(at):
            yield at


def day_rate(t: float) -> float:
    """Live sessions per minute over a working day (t in seconds from midnight)."""
    h = t / HOUR
    night = 0.02  # ~1 per hour
    morning = 2.0 * math.exp(-(((h - 9.5) / 0.8) ** 2))
    midday = 0.8 * math.exp(-(((h - 12.0) / 2.5) ** 2)) if 7 <= h <= 19 else 0.0
    afternoon = 1.6 * math.exp(-(((h - 15.0) / 1.3) ** 2))
    evening = 0.3 * math.exp(-(((h - 18.5) / 1.0) ** 2))
    if h >= 21:
        return night if h < 22.5 else 0.0  # the day's last session before 22:30
    return night + morning + midday + afternoon + evening


def day_trace(rng: random.Random) -> Trace:
    jump_at = 11 * HOUR

    def rate(t: float) -> float:
        base = day_rate(t)
        if jump_at <= t < jump_at + JUMP_LEN_S:
            base = 10 * day_rate(jump_at)
        return base / 60.0

    live = [Acquire(t, "live", session_s(rng)) for t in poisson_arrivals(rng, rate, 0, DAY, 0.5)]
    anim = []
    for hour in (2.0, 13.25, 20.0):
        n = rng.randint(40, 120)
        anim += [Acquire(hour * HOUR + i * 0.05, "anim", 600.0) for i in range(n)]
    return Trace("day", sorted(live + anim, key=lambda a: a.at), jump_at, DAY)


def flat_trace(rng: random.Random) -> Trace:
    jump_at = 3 * HOUR
    base = 0.5  # per minute
    noise = [rng.uniform(0.3, 2.0) for _ in range(int(DAY // 600) + 1)]
    spikes = [rng.uniform(0, DAY) for _ in range(12)]

    def rate(t: float) -> float:
        if jump_at <= t < jump_at + JUMP_LEN_S:
            return 10 * base / 60.0
        r = base * noise[int(t // 600)]
        if any(s <= t < s + 120 for s in spikes):
            r *= 4
        return r / 60.0

    live = [Acquire(t, "live", session_s(rng)) for t in poisson_arrivals(rng, rate, 0, DAY, 0.2)]
    anim = [Acquire(h * HOUR + i * 0.05, "anim", 600.0) for h in (6, 18) for i in range(60)]
    return Trace("flat", sorted(live + anim, key=lambda a: a.at), jump_at, DAY + 600.0)


@dataclass
class Result:
    hits: int = 0
    misses: int = 0
    waits: list[float] = field(default_factory=list)
    outcomes: list[tuple[float, bool]] = field(default_factory=list)  # (at, hit)
    after_lull: int = 0  # misses with no live acquire in the scale-down window before
    idle_s: float = 0.0  # ready, not leased
    warming_s: float = 0.0  # started, not ready yet
    leased_s: float = 0.0
    emptied_at: float | None = None


def simulate(trace: Trace, shape: PoolShape, cold_s: float, policy: Policy = target) -> Result:
    """The pool over the trace: refill each second and after each acquire."""
    result = Result()
    demand = Demand()
    idle = 0
    warming: list[float] = []  # ready times, sorted
    last_change = 0.0
    live = [a for a in trace.acquires if a.cls == "live"]
    last_live = live[-1].at

    def advance(now: float) -> None:
        nonlocal idle, last_change
        # Workers that became ready before `now`; the pool's size is piecewise constant.
        while warming and warming[0] <= now:
            ready = warming[0]
            result.idle_s += idle * (ready - last_change)
            result.warming_s += len(warming) * (ready - last_change)
            warming.pop(0)
            last_change = ready
            idle += 1
        result.idle_s += idle * (now - last_change)
        result.warming_s += len(warming) * (now - last_change)
        last_change = now

    def refill(now: float) -> None:
        nonlocal idle
        wanted = policy(shape, demand, now, cold_s)
        have = idle + len(warming)
        if have < wanted:
            for _ in range(wanted - have):
                bisect.insort(warming, now + cold_s)
        elif have > wanted and idle:
            idle -= min(idle, have - wanted)
        if result.emptied_at is None and now >= last_live and idle + len(warming) == 0:
            result.emptied_at = now

    i = 0
    second = 0.0
    while second <= trace.end:
        while i < len(live) and live[i].at <= second:
            acquire = live[i]
            i += 1
            advance(acquire.at)
            hit = idle > 0
            if hit:
                idle -= 1
                result.hits += 1
                result.waits.append(0.0)
            else:
                result.misses += 1
                result.waits.append(cold_s)
                previous = demand.last_acquire(acquire.at)
                if previous is None or acquire.at - previous > FOLLOW.scaledown_s:
                    result.after_lull += 1
            result.outcomes.append((acquire.at, hit))
            result.leased_s += acquire.session_s
            demand.saw(acquire.at)
            refill(acquire.at)
        advance(second)
        refill(second)
        second += 1.0
        # Nothing to do until the next acquire: a fixed pool's target never moves, and
        # a pool at its min without demand in the window stays there.
        last = demand.last_acquire(second)
        quiet = last is None or second - last > shape.scaledown_s
        if shape.min == shape.max or (quiet and idle + len(warming) == shape.min):
            upcoming = live[i].at if i < len(live) else trace.end
            second = max(second, float(math.ceil(upcoming)))
    return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def recovery(result: Result, jump_at: float) -> tuple[float, float | None]:
    """Seconds from the jump until the trailing-30 s hit ratio stays >= 95 % for the rest
    of the jump, and the jump's last miss (seconds after the jump, None if none)."""
    during = [(at, hit) for at, hit in result.outcomes if jump_at <= at < jump_at + JUMP_LEN_S]
    last_bad: float | None = None
    last_miss: float | None = None
    for k, (at, hit) in enumerate(during):
        if not hit:
            last_miss = at - jump_at
        window = [h for a, h in during[: k + 1] if at - a < ROLLING_S]
        if sum(window) / len(window) < ROLLING_GOAL:
            last_bad = at
    if last_bad is None:
        return 0.0, last_miss
    after = [at for at, _ in during if at > last_bad]
    back = (after[0] if after else jump_at + JUMP_LEN_S) - jump_at
    return back, last_miss


def sized(trace: Trace, cold_s: float) -> tuple[int, int]:
    """Fixed pools sized from the trace: for its peak (the jump left out) and its mean."""
    times = [
        a.at
        for a in trace.acquires
        if a.cls == "live" and not trace.jump_at <= a.at < trace.jump_at + JUMP_LEN_S
    ]
    window = max(cold_s, 1.0)
    peak = max(bisect.bisect_right(times, t + window) - k for k, t in enumerate(times))
    busy_hours = len({int(t // HOUR) for t in times})
    mean = math.ceil(len(times) / (busy_hours * HOUR) * cold_s)
    return max(1, peak), max(1, mean)


def report(trace: Trace, with_what_if: bool) -> None:
    live = [a for a in trace.acquires if a.cls == "live"]
    anim = [a for a in trace.acquires if a.cls == "anim"]
    jumped = sum(1 for a in live if trace.jump_at <= a.at < trace.jump_at + JUMP_LEN_S)
    leased_h = sum(a.session_s for a in live) / HOUR
    print(
        f"\ntrace {trace.name}: {len(live)} live acquires ({jumped} in the 10x jump at "
        f"{trace.jump_at / HOUR:05.2f} h), {len(anim)} anim acquires (not the pool's); "
        f"leased: {leased_h:.1f} worker-hours of live sessions"
    )
    print(
        f"{'backend':<11}{'pool':<10}{'hits':>8}{'lull/jump/rest':>15}{'p50':>5}{'p99':>6}"
        f"{'idle h':>8}{'/leased':>8}{'warm h':>7}{'$':>8}{'$@0.86':>8}{'jump→95%':>9}"
        f"{'last miss':>10}{'empty':>7}"
    )
    for backend, cold_s in COLD_S.items():
        peak, mean = sized(trace, cold_s)
        pools: list[tuple[str, PoolShape, Policy]] = [
            ("follow", FOLLOW, target),
            (f"peak={peak}", PoolShape.fixed(peak), target),
            (f"mean={mean}", PoolShape.fixed(mean), target),
        ]
        if with_what_if:
            pools[1:1] = [("what-if", FOLLOW, what_if), ("min=1", FOLLOW_MIN1, target)]
        for label, shape, policy in pools:
            r = simulate(trace, shape, cold_s, policy)
            back, last_miss = recovery(r, trace.jump_at)
            in_jump = sum(
                1
                for at, hit in r.outcomes
                if not hit and trace.jump_at <= at < trace.jump_at + JUMP_LEN_S
            )
            causes = f"{r.after_lull}/{in_jump}/{r.misses - r.after_lull - in_jump}"
            idle_h, warming_h = r.idle_s / HOUR, r.warming_s / HOUR
            paid_h = idle_h + warming_h
            empty = "never" if r.emptied_at is None else f"{r.emptied_at - live[-1].at:.0f}"
            print(
                f"{backend:<11}{label:<10}{r.hits / (r.hits + r.misses):>8.2%}{causes:>15}"
                f"{percentile(r.waits, 0.5):>5.0f}{percentile(r.waits, 0.99):>6.0f}"
                f"{idle_h:>8.1f}{idle_h / leased_h:>8.1%}{warming_h:>7.1f}"
                f"{paid_h * PRICE[backend]:>8.2f}{paid_h * REFERENCE_PRICE:>8.2f}"
                f"{back:>9.0f}{'-' if last_miss is None else f'{last_miss:.0f}':>10}"
                f"{empty:>7}"
            )
    print(
        f"goals (runpod, follow): hits >= 99 %, idle <= 15 % of leased, jump→95% <= "
        f"{COLD_S['runpod'] + 30:.0f} s, empty <= {FOLLOW.scaledown_s + 30:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument(
        "--what-if",
        action="store_true",
        help="also a pool sized for the 99th percentile (see what_if) and one with min 1",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    print(
        f"pool 'follow' = {FOLLOW}; cold starts (s) {COLD_S}; prices ($/h) {PRICE}; "
        f"seed {args.seed}"
    )
    report(day_trace(random.Random(args.seed)), args.what_if)
    report(flat_trace(random.Random(args.seed + 1)), args.what_if)
    print(f"\n(simulated in {time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
