#!/usr/bin/env python
"""GET /v1/leases latency with 10,000 active leases in the store.

The service is started first on an empty SQLite file (its start-up reconciliation runs
on nothing), then the bench inserts the leases straight into the file while it runs
(SQLite WAL lets another process write; the `.lock` file only keeps out a second
*scheduler*). RECONCILE_INTERVAL_SECONDS=86400 keeps the periodic reconciliation, which
would mark these container-less leases `lost`, from running during the measurement;
expiries are 8 h ahead, so the sweeper has nothing to do either. See bench/README.md.

Each sample is one request on a keep-alive connection, timed until the whole body is
received (the client does not parse it inside the timing). Printed:
  steady  the listing unchanged between requests
  cold    the first listing after the 10,000 leases appeared (nothing reused)
  churn   the goal's figure: one new lease inserted (untimed) before each request
and a check that the body is byte for byte what the service rendered before its
listing cache (every row -> LeaseRecord.wire() -> JSONResponse).

    .venv/bin/python bench/list_leases.py [--leases 10000] [--requests 200] [--churn 50]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    Seeder,
    Service,
    ensure_src_on_path,
    lease_rows,
    reference_body,
    summary,
)

GOAL_P50_MS = 50.0


def timed_get(svc: Service) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    r = svc.http.get("/v1/leases")
    body = r.content
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"GET /v1/leases: {r.status_code} {r.text[:200]}")
    return elapsed, body


def measure(svc: Service, requests: int, max_seconds: float) -> tuple[list[float], int]:
    samples: list[float] = []
    size = 0
    deadline = time.monotonic() + max_seconds
    for _ in range(requests):
        if time.monotonic() > deadline:
            print("stopped early: --max-seconds reached", file=sys.stderr)
            break
        elapsed, body = timed_get(svc)
        samples.append(elapsed)
        size = len(body)
    return samples, size


def line(name: str, values: list[float]) -> str:
    s = summary(values)
    return (
        f"  {name:7} n={s['n']:<4} p50 {s['p50'] * 1000:7.1f} ms   "
        f"p90 {s['p90'] * 1000:7.1f}   p99 {s['p99'] * 1000:7.1f}   "
        f"min {s['min'] * 1000:7.1f}   max {s['max'] * 1000:7.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--churn", type=int, default=50, help="requests with one new lease before each (0: skip)"
    )
    parser.add_argument("--max-seconds", type=float, default=300)
    args = parser.parse_args()
    if not (
        1 <= args.leases <= 200_000 and 1 <= args.requests <= 10_000 and 0 <= args.churn <= 1000
    ):
        parser.error("--leases 1..200000, --requests 1..10000, --churn 0..1000")
    ensure_src_on_path()

    svc = Service("list", SWEEP_INTERVAL_SECONDS="3600", RECONCILE_INTERVAL_SECONDS="86400")
    seeder: Seeder | None = None
    try:
        svc.start()
        empty, _ = measure(svc, 50, 30)
        seeder = Seeder(svc.db_path)
        t0 = time.perf_counter()
        seeder.insert(lease_rows(args.leases))
        seeded_s = time.perf_counter() - t0
        cold, body = timed_get(svc)
        first = body.count(b'"lease_id"')
        if first != args.leases:
            raise RuntimeError(f"expected {args.leases} active leases, the service lists {first}")
        measure(svc, args.warmup, 60)
        samples, size = measure(svc, args.requests, args.max_seconds)
        churn: list[float] = []
        deadline = time.monotonic() + args.max_seconds
        for _ in range(args.churn):
            if time.monotonic() > deadline:
                break
            seeder.insert(lease_rows(1))
            churn.append(timed_get(svc)[0])
        _, final = timed_get(svc)
        identical = final == asyncio.run(reference_body(svc.db_path))
        alive = svc.proc is not None and svc.proc.poll() is None
        listed = final.count(b'"lease_id"')
    finally:
        if seeder is not None:
            seeder.close()
        svc.cleanup()

    print(
        f"GET /v1/leases, {args.leases} active leases (inserted in {seeded_s:.2f} s); "
        f"body {size / 1024 / 1024:.2f} MiB; times until the whole body is received"
    )
    print(line("steady", samples) + f"   (after {args.warmup} warm-up)")
    print(f"  cold    first listing after the insert: {cold * 1000:.1f} ms")
    if churn:
        print(line("churn", churn) + "   (+1 lease before each)")
    print(line("empty", empty) + "   (empty store, for scale)")
    p50 = summary(churn or samples)["p50"] * 1000
    which = "churn" if churn else "steady"
    print(
        f"  goal {which} p50 <= {GOAL_P50_MS:.0f} ms: "
        f"{'met' if p50 <= GOAL_P50_MS else 'MISSED'}"
        f"; body identical to the uncached rendering: {identical}; service alive: {alive}; "
        f"{listed} active at the end"
    )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
