"""Callers with priorities (docs/concepts/priorities.md#priorities-and-preemption), two figures:

1. **A live acquire at a full cluster.** Local Docker capped at `--cap` workers, all held
   by anim leases; a live-control acquire (`wait_seconds` 120) is served by preempting
   the newest of them: its time from request to answer, p50 and p99, with
   PREEMPTION_GRACE_SECONDS 0 and with the default (30). The reference, measured in the
   same run on the same scheduler: a cold start (the same acquire on a cluster with
   room). The goal: a live caller is served within the grace plus one start.
2. **What the line costs per waiter.** Two replicas on one PostgreSQL database, a static
   pool whose one endpoint is leased; 1,000 callers wait in line (500 on each replica,
   each on a connection of its own) for `--hold` seconds: the replicas' CPU per
   waiter-second and memory per waiter, and `GET /health` p50/p99 with them waiting
   beside the same with nobody waiting (the issue's bound: p99 ≤ 50 ms).

    .venv/bin/python bench/priorities.py [--cap 3] [--rounds 10] [--default-rounds 4]
                                         [--waiters 1000] [--hold 20]
                                         [--pg-host /var/run/postgresql]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Service, cpu_seconds, rss_kib, summary  # noqa: E402
from replicas import fresh_database, replica_set  # noqa: E402

CLASSES = {
    "PRIORITY_CLASSES": "live=100:preempts,default=50,anim=10:preemptible",
    "OWNER_PRIORITY_CLASSES": "live-control=live,anim=anim",
}


def _acquire(service: Service, **body: Any) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    response = service.http.post("/v1/lease", json={"kind": "renderer", **body})
    took = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"acquire answered {response.status_code}: {response.text}")
    return took, response.json()["lease"]


def _release(service: Service, lease: dict[str, Any]) -> None:
    owner = lease.get("owner_id")
    headers = {"X-Lease-Owner": owner} if owner else {}
    service.http.delete(f"/v1/lease/{lease['lease_id']}", headers=headers)


def live_at_full_cluster(cap: int, grace: float, rounds: int) -> dict[str, Any]:
    """Seconds for a live acquire at a cluster full of anim leases, and for a cold
    start on the same scheduler with room."""
    env = {
        "LOCAL_DOCKER_MAX_WORKERS": str(cap),
        "PREEMPTION_GRACE_SECONDS": str(grace),
        "SWEEP_INTERVAL_SECONDS": "30",
        **CLASSES,
    }
    cold, live = [], []
    with Service("prio", **env) as service:
        service.start()
        _release(service, _acquire(service, ttl_seconds=60)[1])  # network made, image warm
        for _ in range(rounds):
            took, lease = _acquire(service, owner_id="anim", ttl_seconds=600)
            cold.append(took)
            _release(service, lease)
        held = [_acquire(service, owner_id="anim", ttl_seconds=600)[1] for _ in range(cap)]
        for i in range(rounds):
            took, lease = _acquire(
                service,
                owner_id="live-control",
                correlation_id=f"live-{i}",
                wait_seconds=120,
                ttl_seconds=600,
            )
            live.append(took)
            _release(service, lease)
            # The cluster full of anim leases again.
            held = [h for h in held if _state(service, h) in ("active", "preempting")]
            while len(held) < cap:
                held.append(_acquire(service, owner_id="anim", ttl_seconds=600)[1])
        for lease in held:
            _release(service, lease)
    return {"cold": summary(cold), "live": summary(live)}


def _state(service: Service, lease: dict[str, Any]) -> str:
    return str(service.http.get(f"/v1/lease/{lease['lease_id']}").json()["state"])


async def _wait_in_line(services: list[Service], n: int) -> list[asyncio.StreamWriter]:
    writers = []
    for i in range(n):
        service = services[i % len(services)]
        payload = json.dumps(
            {"kind": "renderer", "wait_seconds": 300, "owner_id": f"w{i % 50}"}
        ).encode()
        _, writer = await asyncio.open_connection("127.0.0.1", service.port)
        writer.write(
            b"POST /v1/lease HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
            + f"X-Internal-Secret: {service.secret}\r\n".encode()
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        writers.append(writer)
        if i % 100 == 99:
            await asyncio.gather(*(w.drain() for w in writers[-100:]))
    return writers


def _waiting(service: Service) -> float:
    text = httpx.get(f"{service.url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("scheduler_waiting_callers_per_class{")
    )


def _health(services: list[Service], n: int = 300) -> dict[str, float]:
    times = []
    with httpx.Client() as client:
        for i in range(n):
            started = time.perf_counter()
            client.get(f"{services[i % len(services)].url}/health")
            times.append(time.perf_counter() - started)
    return summary(times)


def line_cost(pg_host: str, waiters: int, hold: float) -> dict[str, Any]:
    # One endpoint, leased: every caller after it waits.
    with fresh_database(pg_host) as url, replica_set(url, 2, 1) as services:
        _acquire(services[0], ttl_seconds=3600)
        pids = [s.pid for s in services]
        idle_health = _health(services)
        rss_before = sum(rss_kib(p)["VmRSS"] for p in pids)

        async def run() -> dict[str, Any]:
            writers = await _wait_in_line(services, waiters)
            try:
                deadline = time.monotonic() + 120
                while sum(_waiting(s) for s in services) < waiters:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the callers did not all get in line")
                    await asyncio.sleep(0.2)
                rss_waiting = sum(rss_kib(p)["VmRSS"] for p in pids)
                cpu_before = cpu_seconds(pids)
                await asyncio.sleep(hold)
                cpu = cpu_seconds(pids) - cpu_before
                health = await asyncio.to_thread(_health, services)
                return {"cpu": cpu, "rss": rss_waiting, "health": health}
            finally:
                for writer in writers:
                    writer.close()

        waited = asyncio.run(run())
    return {
        "waiters": waiters,
        "hold_s": hold,
        "cpu_ms_per_waiter_second": waited["cpu"] * 1e3 / (waiters * hold),
        "cpu_share_of_one_core": waited["cpu"] / hold,
        "kib_per_waiter": (waited["rss"] - rss_before) / waiters,
        "health_idle": idle_health,
        "health_waiting": waited["health"],
    }


def _ms(stats: dict[str, float]) -> str:
    return f"p50 {stats['p50'] * 1e3:8.1f} ms   p99 {stats['p99'] * 1e3:8.1f} ms   (n={stats['n']})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10, help="rounds with grace 0")
    parser.add_argument("--default-rounds", type=int, default=4, help="rounds with grace 30")
    parser.add_argument("--waiters", type=int, default=1000)
    parser.add_argument("--hold", type=float, default=20.0)
    parser.add_argument("--pg-host", default="/var/run/postgresql")
    parser.add_argument("--skip-preempt", action="store_true")
    parser.add_argument("--skip-line", action="store_true")
    args = parser.parse_args()

    if not args.skip_preempt:
        print(f"A live acquire at a cluster of {args.cap} Docker workers full of anim leases")
        for grace, rounds in ((0.0, args.rounds), (30.0, args.default_rounds)):
            figures = live_at_full_cluster(args.cap, grace, rounds)
            print(f"  grace {grace:4.0f} s   cold start (room): {_ms(figures['cold'])}")
            print(f"  grace {grace:4.0f} s   live, preempting:  {_ms(figures['live'])}")
    if not args.skip_line:
        cost = line_cost(args.pg_host, args.waiters, args.hold)
        print(f"The line: {cost['waiters']} callers waiting {cost['hold_s']:.0f} s, 2 replicas")
        print(
            f"  CPU {cost['cpu_ms_per_waiter_second']:.4f} ms per waiter-second "
            f"({cost['cpu_share_of_one_core'] * 100:.1f} % of one core for all of them)"
        )
        print(f"  memory {cost['kib_per_waiter']:.1f} KiB per waiter")
        print(f"  GET /health, nobody waiting:      {_ms(cost['health_idle'])}")
        print(f"  GET /health, {cost['waiters']} waiting:     {_ms(cost['health_waiting'])}")


if __name__ == "__main__":
    main()
