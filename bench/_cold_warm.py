"""Cold and warm acquire on a provider beside Docker, in one run (bench/modal.py,
bench/k8s.py): the schedulers each script starts, and what both measure and print.

Each scheduler has WARM_POOL=renderer/none=1 and readiness probed at /healthz (`COMMON`).
Per round, on each in turn:
  cold  one acquire of kind=anim (no pool for anim: a worker is made and probed), then
        released;
  warm  one acquire of kind=renderer served by the idle pool worker (the hand-off),
        then released, and the pool refilled before the next round.
Latency is request sent to answer read."""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable
from typing import Any

from _common import Service, summary

COMMON = {
    "WARM_POOL": "renderer/none=1",
    "RENDERER_READY_PATH": "/healthz",
    "ANIM_READY_PATH": "/healthz",
}


def idle(service: Service) -> int:
    answer = service.http.get("/v1/leases", params={"state": "idle"})
    return len(answer.json())


def timed(service: Service, kind: str) -> float:
    started = time.perf_counter()
    response = service.http.post("/v1/lease", json={"kind": kind, "ttl_seconds": 300})
    took = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{kind} acquire answered {response.status_code}: {response.text}")
    service.http.delete(f"/v1/lease/{response.json()['lease']['lease_id']}")
    return took


def wait_pool(service: Service, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while idle(service) < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the pool did not refill")
        time.sleep(0.1)


Extra = Callable[[dict[str, Service], int], dict[str, dict[str, list[float]]]]


def main(
    description: str,
    schedulers: Callable[[], contextlib.AbstractContextManager[dict[str, Service]]],
    extra: Extra | None = None,
) -> None:
    """`--rounds N` (10) rounds on the schedulers `schedulers()` starts, by name; print
    p50, p99 and max of each, cold and warm, and of what `extra(services, rounds)` adds
    (more figures, {scheduler: {what: latencies}}), measured after them."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    figures: dict[str, dict[str, list[float]]] = {}
    with schedulers() as services:
        for service in services.values():
            wait_pool(service)
            timed(service, "anim")  # the first of each: network, image, client made
        for _ in range(args.rounds):
            for name, service in services.items():
                got = figures.setdefault(name, {"cold": [], "warm": []})
                got["cold"].append(timed(service, "anim"))
                wait_pool(service)
                got["warm"].append(timed(service, "renderer"))
        for service in services.values():
            wait_pool(service)
        for name, more in (extra(services, args.rounds) if extra else {}).items():
            figures.setdefault(name, {}).update(more)
    print(f"Acquire, request to answer, {args.rounds} rounds (2-core host)")
    width = max(map(len, figures))
    for name, got in figures.items():
        for how in got:
            stats: dict[str, Any] = summary(got[how])
            print(
                f"  {name:{width}s} {how}: p50 {stats['p50'] * 1e3:7.1f} ms   "
                f"p99 {stats['p99'] * 1e3:7.1f} ms   max {stats['max'] * 1e3:7.1f} ms"
            )
