#!/usr/bin/env python
"""How late a lease is released after its `expires_at`: the sweeper's precision.

Leases with short TTLs (1-5 s, spread so expiries do not all fall together) are taken
from a static pool and left to expire; each one's `released_at - expires_at` is read
back with `GET /v1/lease/{id}`. A second pass does the same on local Docker, where the
release destroys a container. The sweeper's interval is left at its default (30 s): it
must wake at each expiry by itself.

Goal: every lease released within 2 s of its expires_at (max lateness <= 2 s).

    .venv/bin/python bench/expiry.py [--leases 40] [--docker 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Service, summary  # noqa: E402

GOAL_S = 2.0
WAIT_LIMIT_S = 60.0


def lateness(svc: Service, count: int) -> list[float]:
    """Acquire `count` leases with TTLs of 1-5 s, wait for them to end, and return how
    many seconds after its expires_at each was released."""
    ids = []
    for i in range(count):
        r = svc.http.post("/v1/lease", json={"kind": "renderer", "ttl_seconds": 1 + i % 5})
        if r.status_code != 200:
            raise RuntimeError(f"acquire: {r.status_code} {r.text}")
        ids.append(r.json()["lease"]["lease_id"])
    late: dict[str, float] = {}
    deadline = time.monotonic() + WAIT_LIMIT_S
    while len(late) < len(ids) and time.monotonic() < deadline:
        time.sleep(0.5)
        for lease_id in ids:
            if lease_id in late:
                continue
            lease = svc.http.get(f"/v1/lease/{lease_id}").json()
            if lease["state"] == "released":
                late[lease_id] = (
                    _moment(lease["released_at"]) - _moment(lease["expires_at"])
                ).total_seconds()
    if len(late) < len(ids):
        raise RuntimeError(
            f"{len(ids) - len(late)} lease(s) not released within {WAIT_LIMIT_S:.0f} s"
        )
    return list(late.values())


def _moment(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def show(name: str, values: list[float]) -> bool:
    s = summary(values)
    print(
        f"  {name:<14} n={len(values):<4} p50 {s['p50']:6.3f} s   p90 {s['p90']:6.3f}   "
        f"max {s['max']:6.3f}   min {s['min']:6.3f}"
    )
    return s["max"] <= GOAL_S


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=40, help="static leases (1..500)")
    parser.add_argument("--docker", type=int, default=5, help="Docker leases (0..20)")
    args = parser.parse_args()
    if not (1 <= args.leases <= 500 and 0 <= args.docker <= 20):
        parser.error("--leases 1..500, --docker 0..20")
    pool = ",".join(f"http://w{i}:8080" for i in range(args.leases))
    print("lateness of release after expires_at (released_at - expires_at)")
    ok = True
    with Service("expiry", PROVIDERS="static", STATIC_WORKERS=f"renderer={pool}") as svc:
        svc.start()
        ok &= show("static", lateness(svc, args.leases))
    if args.docker:
        with Service("expiry-d") as svc:
            svc.start()
            ok &= show("local-docker", lateness(svc, args.docker))
    print(
        f"  goal every lease released within {GOAL_S:.0f} s of expires_at: "
        f"{'met' if ok else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
