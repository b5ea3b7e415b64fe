#!/usr/bin/env python
"""A pool that follows demand, live: a compressed trace (10 minutes) against the real
service on Docker (issue 37; the day-long simulation of the same policy is pool_sim.py).

One scheduler, its pool `WARM_POOL=renderer/none@live=min:0,max:12,buffer:1` for
live-control only (PRIORITY_CLASSES live/default/anim, OWNER_PRIORITY_CLASSES
live-control=live, anim=anim), WARM_POOL_SCALEDOWN_SECONDS=60 (the day's 300 s, shortened
with the trace), its workers priced at 0.69 $/h (RunPod's `entry` price in pool_sim.py).
The trace, seeded, live-control sessions (renderer, 4-12 s each, held then released):

  0-60 s     quiet: ~3 sessions a minute
  60-240 s   a ramp to ~12 a minute
  240-300 s  a 10x jump: ~120 a minute
  300-360 s  back to ~6 a minute
  360-480 s  a lull: none (the pool empties after its scale-down window)
  480-600 s  ~6 a minute again (the first goes cold and brings the pool back)

and anim batches of 10 renderer acquires at once at 120 s and 420 s (class anim: not the
pool's; they go cold and leave its workers alone).

Each acquire's answer says whether it was served warm and how long it waited on its
worker (`Server-Timing: worker;desc=...;dur=`): its latency less that is the scheduler's
own share. Printed: live acquires served warm (all; outside the first cold start of the
jump), wait p50/p99 warm and cold, the scheduler's own share p50/p99 of warm ones, the
pool's idle worker-seconds (scheduler_pool_idle_worker_seconds_total) against the leased
ones (held sessions), its cost (GET /v1/usage, owner `pool`), seconds from the jump until
the hit ratio over the trailing 10 s stays >= 95 %, seconds from the last acquire before
the lull until the pool is empty (scale-down 60 s), and how anim fared (never a pool hit).

16 warm acquires at once against a full pool, with the scheduler's share apart, is
`warm_pool.py`.

    .venv/bin/python bench/pool_live.py [--seed 37]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Service, summary, worker_timing  # noqa: E402

PRICE = 0.69
SCALEDOWN_S = 60.0
JUMP = (240.0, 300.0)
LULL = (360.0, 480.0)
ROLLING_S = 10.0
# Sessions a minute over the trace: (start, end, rate).
PHASES = [
    (0.0, 60.0, 3.0),
    (60.0, 240.0, None),  # the ramp: 3 → 12
    (240.0, 300.0, 120.0),
    (300.0, 360.0, 6.0),
    (480.0, 600.0, 6.0),
]
ANIM_BATCHES = [(120.0, 10), (420.0, 10)]


@dataclass
class Acquired:
    at: float  # seconds into the trace it was sent
    cls: str
    latency: float
    worker: float
    how: str
    held: float = 0.0


def trace(seed: int) -> list[tuple[float, str, float]]:
    """(time, class, session seconds) of every acquire, in order."""
    rng = random.Random(seed)
    out: list[tuple[float, str, float]] = []
    for start, end, rate in PHASES:
        at = start
        while True:
            per_min = rate if rate is not None else 3.0 + 9.0 * (at - start) / (end - start)
            at += rng.expovariate(per_min / 60.0)
            if at >= end:
                break
            out.append((at, "live", rng.uniform(4.0, 12.0)))
    for at, n in ANIM_BATCHES:
        out += [(at, "anim", rng.uniform(4.0, 12.0)) for _ in range(n)]
    return sorted(out)


async def replay(
    service: Service, seed: int
) -> tuple[list[Acquired], list[tuple[float, int, int, int]]]:
    owners = {"live": "live-control", "anim": "anim"}
    results: list[Acquired] = []
    samples: list[tuple[float, int, int, int]] = []  # (t, target, idle, warming)
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=100)
    async with httpx.AsyncClient(
        base_url=service.url,
        headers={"X-Internal-Secret": service.secret},
        timeout=300,
        limits=limits,
    ) as client:
        began = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - began

        async def one(at: float, cls: str, session: float) -> None:
            await asyncio.sleep(max(0.0, at - now()))
            sent = time.perf_counter()
            body = {"kind": "renderer", "owner_id": owners[cls], "ttl_seconds": 600}
            response = await client.post("/v1/lease", json=body)
            latency = time.perf_counter() - sent
            if response.status_code != 200:
                raise RuntimeError(f"acquire answered {response.status_code}: {response.text}")
            how, waited = worker_timing(response)
            waited = waited or 0.0
            lease = response.json()["lease"]
            done = Acquired(at, cls, latency, waited, how)
            results.append(done)
            held_from = time.perf_counter()
            await asyncio.sleep(session)
            gone = await client.delete(
                f"/v1/lease/{lease['lease_id']}", headers={"X-Lease-Owner": owners[cls]}
            )
            if gone.status_code != 204:
                raise RuntimeError(f"release answered {gone.status_code}: {gone.text}")
            done.held = time.perf_counter() - held_from

        async def watch(stop: asyncio.Event) -> None:
            while not stop.is_set():
                pools = (await client.get("/v1/pools")).json()
                p = pools[0]
                samples.append((now(), p["target"], p["idle"], p["warming"]))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)

        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        await asyncio.gather(*(one(at, cls, s) for at, cls, s in trace(seed)))
        # The last sessions ended: watch the pool empty after its window.
        last_live = max(a.at for a in results if a.cls == "live")
        while now() < last_live + SCALEDOWN_S + 30:
            await asyncio.sleep(1.0)
        stop.set()
        await watcher
    return results, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=37)
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with Service(
        "pooll",
        WARM_POOL="renderer/none@live=min:0,max:12,buffer:1",
        WARM_POOL_SCALEDOWN_SECONDS=str(SCALEDOWN_S),
        PRIORITY_CLASSES="live=100:preempts,default=50,anim=10:preemptible",
        OWNER_PRIORITY_CLASSES="live-control=live,anim=anim",
        LOCAL_DOCKER_PRICE_PER_HOUR=str(PRICE),
        LOCAL_DOCKER_MAX_WORKERS="80",
        RENDERER_READY_PATH="/healthz",
        ANIM_READY_PATH="/healthz",
    ).start() as service:
        results, samples = asyncio.run(replay(service, args.seed))
        metrics = service.http.get("/metrics").text
        idle_s = sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("scheduler_pool_idle_worker_seconds_total{")
        )
        usage = service.http.get("/v1/usage", params={"group_by": "owner"}).json()
        pool_cost = sum(g["cost"] for g in usage["groups"] if g["key"] == "pool")
        pool_hours = sum(g["lease_hours"] for g in usage["groups"] if g["key"] == "pool")
    live = [a for a in results if a.cls == "live"]
    anim = [a for a in results if a.cls == "anim"]
    warm = [a for a in live if a.how == "warm"]
    cold = [a for a in live if a.how != "warm"]
    leased_s = sum(a.held for a in live)
    print(f"\n{len(live)} live acquires, {len(anim)} anim; pool renderer/none@live min 0 max 12")
    print(f"live served warm: {len(warm) / len(live):.1%} ({len(warm)}/{len(live)})")
    for name, group in (("warm", warm), ("cold", cold)):
        if group:
            s = summary([a.latency for a in group])
            print(
                f"  {name} wait: p50 {s['p50'] * 1e3:.1f} ms, "
                f"p99 {s['p99'] * 1e3:.1f} ms (n {s['n']})"
            )
    if warm:
        own = summary([a.latency - a.worker for a in warm])
        hand = summary([a.worker for a in warm])
        print(
            f"  warm, the scheduler's own share: p50 {own['p50'] * 1e3:.1f} ms, "
            f"p99 {own['p99'] * 1e3:.1f} ms; the hand-off: p50 {hand['p50'] * 1e3:.1f} ms"
        )
    print(
        f"idle worker-seconds {idle_s:.0f} against leased {leased_s:.0f} "
        f"({idle_s / leased_s:.1%}); the pool in usage: {pool_hours * 3600:.0f} worker-s "
        f"(idle and warming), ${pool_cost:.4f} at {PRICE} $/h"
    )
    start, end = JUMP
    in_jump = [a for a in live if start <= a.at < end]
    recovered = None
    for a in in_jump:
        after = [b for b in in_jump if b.at >= a.at]
        window_ok = all(
            sum(c.how == "warm" for c in in_jump if b.at - ROLLING_S <= c.at <= b.at)
            >= 0.95 * sum(1 for c in in_jump if b.at - ROLLING_S <= c.at <= b.at)
            for b in after
        )
        if window_ok:
            recovered = a.at - start
            break
    misses = [a.at - start for a in in_jump if a.how != "warm"]
    print(
        f"10x jump ({len(in_jump)} acquires): hits {sum(a.how == 'warm' for a in in_jump)}"
        f"/{len(in_jump)}; last miss {max(misses, default=0):.1f} s after it; back to >= 95 % "
        f"(trailing {ROLLING_S:.0f} s) {'never' if recovered is None else f'{recovered:.1f} s'}"
    )
    before_lull = max(a.at for a in live if a.at < LULL[0])
    empty = next(
        (t for t, _, i, w in samples if t > before_lull and i + w == 0 and t < LULL[1]), None
    )
    print(
        f"empty after the last acquire before the lull: "
        f"{'never' if empty is None else f'{empty - before_lull:.0f} s'} "
        f"(scale-down {SCALEDOWN_S:.0f} s)"
    )
    print(f"anim: {sum(a.how == 'warm' for a in anim)} of {len(anim)} served by the pool (goal 0)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
