#!/usr/bin/env python
"""Resident memory (VmRSS from /proc/<pid>/status) of the service process: idle, then
with 10,000 active leases after listing them a few times. Any process the service
starts is shown on its own line and counted in the total held against the goal (the
service before the redesign started a SQLite sync helper; it starts none now).

Same set-up as list_leases.py: the service starts on an empty SQLite file, the leases
are inserted into it while it runs, and RECONCILE_INTERVAL_SECONDS=86400 keeps the
periodic reconciliation from marking them lost. VmHWM (the peak RSS) is printed too:
it shows what the listing needed at its highest, not only what stays afterwards.

    .venv/bin/python bench/memory.py [--leases 10000] [--lists 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    Service,
    ensure_src_on_path,
    process_tree,
    rss_kib,
    seed_active_leases,
)

GOAL_MIB = 150.0


def mib(kib: int) -> str:
    return f"{kib / 1024:6.1f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--lists", type=int, default=5, help="GET /v1/leases this many times")
    args = parser.parse_args()
    if not (1 <= args.leases <= 200_000 and 1 <= args.lists <= 1000):
        parser.error("--leases must be 1..200000 and --lists 1..1000")
    ensure_src_on_path()

    svc = Service("mem", SWEEP_INTERVAL_SECONDS="3600", RECONCILE_INTERVAL_SECONDS="86400")
    try:
        svc.start()
        # Idle: started, one request of each kind served, then a moment to settle.
        svc.http.get("/v1/leases").raise_for_status()
        svc.http.get("/metrics").raise_for_status()
        time.sleep(1)
        idle = rss_kib(svc.pid)

        seed_active_leases(svc.db_path, args.leases)
        counts = []
        for _ in range(args.lists):
            r = svc.http.get("/v1/leases")
            r.raise_for_status()
            counts.append(len(r.json()))
        time.sleep(1)
        loaded = rss_kib(svc.pid)
        helpers = [rss_kib(pid) for pid in process_tree(svc.pid)[1:]]
        if set(counts) != {args.leases}:
            raise RuntimeError(f"expected {args.leases} leases listed, got {sorted(set(counts))}")
    finally:
        svc.cleanup()

    print("service RSS (VmRSS), pid of `python -m openalice_scheduler serve`")
    print(
        f"  idle (empty store)                       {mib(idle['VmRSS'])}   "
        f"peak so far {mib(idle['VmHWM'])}"
    )
    print(
        f"  {args.leases} active leases, listed {args.lists}x      {mib(loaded['VmRSS'])}   "
        f"peak {mib(loaded['VmHWM'])}"
    )
    helper_kib = sum(h.get("VmRSS", 0) for h in helpers)
    print(f"  child process(es): {len(helpers)}                   {mib(helper_kib)}")
    total = loaded["VmRSS"] + helper_kib
    print(f"  total                                    {mib(total)}")
    ok = total / 1024 <= GOAL_MIB
    print(
        f"  goal <= {GOAL_MIB:.0f} MiB: {'met' if ok else 'MISSED'} "
        f"(peak {'within' if (loaded['VmHWM'] + helper_kib) / 1024 <= GOAL_MIB else 'over'} "
        "the goal too)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
