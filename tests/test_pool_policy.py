"""The warm pool's target as demand moves (issue 37, lifecycle/pool_policy.py): a pure
function of the acquires seen and the time, run here on a moved clock (plain seconds):
ramps, a 10x jump, lulls, scale to zero and back, the bounds, and the money caps."""

from __future__ import annotations

from openalice_scheduler.lifecycle.pool_policy import Demand, PoolShape, afforded, target

COLD_S = 90.0  # a RunPod cold start
SHAPE = PoolShape(min=0, max=50, buffer=1, scaledown_s=300)


def steady(demand: Demand, start: float, end: float, every: float) -> float:
    """One acquire each `every` seconds from `start` until `end`; the last time."""
    at = start
    while at < end:
        demand.saw(at)
        at += every
    return end


def test_a_fixed_pool_keeps_its_number_whatever_the_demand() -> None:
    demand = Demand()
    assert target(PoolShape.fixed(2), demand, 0.0, COLD_S) == 2
    now = steady(demand, 0, 120, 0.5)
    assert target(PoolShape.fixed(2), demand, now, COLD_S) == 2
    assert target(PoolShape.fixed(2), demand, now + 10_000, COLD_S) == 2


def test_the_target_covers_the_acquires_of_one_cold_start_plus_the_buffer() -> None:
    demand = Demand()
    # One acquire every 30 s: 3 expected during a 90 s cold start, and the buffer.
    now = steady(demand, 0, 300, 30)
    assert target(SHAPE, demand, now, COLD_S) == 3 + 1
    # Twice the pace: twice the pool.
    demand = Demand()
    now = steady(demand, 0, 300, 15)
    assert target(SHAPE, demand, now, COLD_S) == 6 + 1


def test_a_tenfold_jump_raises_the_target_at_once() -> None:
    shape = PoolShape(min=0, max=200, buffer=1)
    demand = Demand()
    now = steady(demand, 0, 300, 10)
    before = target(shape, demand, now, COLD_S)
    # Ten times the pace for 6 s: the panic window sees it before the stable one does.
    now = steady(demand, now, now + 6, 1)
    after = target(shape, demand, now, COLD_S)
    assert after >= 10 * (before - 1)
    # One acquire alone in a quiet minute is no jump.
    quiet = Demand()
    quiet.saw(0.0)
    quiet.saw(59.0)
    assert target(shape, quiet, 60.0, COLD_S) <= 1 + 3


def test_a_lull_lowers_the_target_only_after_the_scaledown_window() -> None:
    demand = Demand()
    now = steady(demand, 0, 300, 10)
    high = target(SHAPE, demand, now, COLD_S)
    assert high == 9 + 1
    # Quiet but for one acquire a minute: kept through the window...
    for minute in range(1, 5):
        demand.saw(now + 60 * minute)
        assert target(SHAPE, demand, now + 60 * minute, COLD_S) == high
    # ...lowered once the window has passed since the busy time.
    demand.saw(now + 330)
    assert target(SHAPE, demand, now + 330, COLD_S) < high


def test_min_zero_empties_after_the_window_and_fills_on_the_next_acquire() -> None:
    demand = Demand()
    now = steady(demand, 0, 120, 20)
    last = now - 20
    assert target(SHAPE, demand, now, COLD_S) > 0
    assert target(SHAPE, demand, last + 300, COLD_S) > 0
    assert target(SHAPE, demand, last + 301, COLD_S) == 0
    # The next acquire (cold) brings the pool back.
    demand.saw(last + 3600)
    assert target(SHAPE, demand, last + 3600, COLD_S) >= 1


def test_the_bounds_hold() -> None:
    demand = Demand()
    now = steady(demand, 0, 60, 0.1)
    assert target(PoolShape(min=0, max=5, buffer=2), demand, now, COLD_S) == 5
    assert target(PoolShape(min=3, max=8), Demand(), 0.0, COLD_S) == 3


def test_money_caps_bound_each_pool_and_all_pools_in_order() -> None:
    live, anim = ("renderer", "entry"), ("anim", "none")
    wanted = {live: 6, anim: 4}
    prices = {live: 0.69, anim: 0.5}
    # A pool's own cap: 2 $/h at 0.69 keeps 2 (3 would be 2.07).
    assert afforded(wanted, prices, {live: 2.0, anim: None}, None, [live, anim]) == {
        live: 2,
        anim: 4,
    }
    # All pools within 3 $/h: the first in order takes what it needs (4 x 0.69 = 2.76),
    # the next what is left (0.24: none).
    kept = afforded({live: 4, anim: 4}, prices, {}, 3.0, [live, anim])
    assert kept == {live: 4, anim: 0}
    # The other order: anim first (4 x 0.5 = 2), live with the 1 $/h left (1 worker).
    assert afforded({live: 4, anim: 4}, prices, {}, 3.0, [anim, live]) == {anim: 4, live: 1}
    # Not priced yet under a cap: one worker, whose reservation tells the price.
    assert afforded({live: 5}, {}, {live: 10.0}, None, [live]) == {live: 1}
    # No cap at all: what the demand wants.
    assert afforded({live: 5}, {}, {}, None, [live]) == {live: 5}
