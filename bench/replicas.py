"""Acquire+release round trips per second through one scheduler and through several
replicas sharing one PostgreSQL database, static provider (1,000 endpoints), at 1, 8
and 32 concurrent clients; p50 and p99 latency of one round trip.

    .venv/bin/python bench/replicas.py [--seconds 10] [--clients 1,8,32] [--replicas 2]
                                       [--pg-host /var/run/postgresql]
                                       [--database-url postgresql://...]

CPU ms/round is the CPU time (user + system) the scheduler processes spent per round
trip, from /proc/<pid>/stat: the service's own cost, load generators and PostgreSQL not
counted. It is shown for all replicas together and for each one (its CPU over the round
trips it served), so a reader can see what a replica on cores of its own would add.

The reference, from the same run: `pgbench`'s TPC-B-like load (5 statements per
transaction) on a scratch database of the same server, `pgbench -i` then
`pgbench -c 32 -j 2 -T <seconds>`, with synchronous_commit on (`--no-pgbench` skips it).

The same load shape as bench/throughput.py (POST /v1/lease, then DELETE it), but the
clients are split between the replicas, each replica's share driven by a load
generator process of its own (so, with 2 replicas, 2 generator processes). Each
configuration gets a fresh database on the local server (`--pg-host`; dropped at the
end), or uses `--database-url` (which must point to an empty, dedicated database; the
one-replica run then comes first on it). Replicas share SCHEDULER_INSTANCE and
DOCKER_NETWORK as in production. Traffic stays on 127.0.0.1 and the PostgreSQL socket;
every run is bounded by --seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Service, cpu_seconds, drive, lease_round, percentile  # noqa: E402

STATIC_ENDPOINTS = 1000


# --- the load generator (one process per replica) --------------------------------------


async def _generate(url: str, secret: str, clients: int, seconds: float) -> dict[str, Any]:
    latencies, errors, elapsed = await drive(
        int(url.rsplit(":", 1)[1]),
        {"X-Internal-Secret": secret},
        clients,
        seconds,
        lease_round,
    )
    return {"latencies": [round(x, 6) for x in latencies], "errors": errors, "elapsed": elapsed}


def load(
    urls: list[str], secret: str, clients: int, seconds: float, pids: list[int]
) -> dict[str, Any]:
    """`clients` split between `urls` (one generator process each), run at once; also
    the CPU time the scheduler processes `pids` (one per url) spent per round trip,
    together and each over the round trips it served."""
    cpu_before = [cpu_seconds([pid]) for pid in pids]
    shares = [
        clients // len(urls) + (1 if i < clients % len(urls) else 0) for i in range(len(urls))
    ]
    procs = [
        (
            i,
            subprocess.Popen(
                [sys.executable, __file__, "--generator", url, secret, str(share), str(seconds)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for i, (url, share) in enumerate(zip(urls, shares, strict=True))
        if share
    ]
    latencies: list[float] = []
    rounds = [0] * len(urls)
    rate = 0.0
    errors = 0
    for i, proc in procs:
        out, err = proc.communicate(timeout=seconds + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"load generator failed:\n{err[-3000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        latencies += result["latencies"]
        rounds[i] = len(result["latencies"])
        rate += len(result["latencies"]) / result["elapsed"]
        errors += result["errors"]
    cpu = [cpu_seconds([pid]) - before for pid, before in zip(pids, cpu_before, strict=True)]
    return {
        "cpu_ms": sum(cpu) * 1000 / max(1, len(latencies)),
        # Per replica: its CPU over the round trips it served (none: no clients on it).
        "cpu_ms_each": [
            c * 1000 / n if n else float("nan") for c, n in zip(cpu, rounds, strict=True)
        ],
        "rate": rate,
        "p50_ms": percentile(latencies, 50) * 1000 if latencies else float("nan"),
        "p99_ms": percentile(latencies, 99) * 1000 if latencies else float("nan"),
        "rounds": len(latencies),
        "errors": errors,
        "split": shares,
    }


# --- databases and replicas ------------------------------------------------------------


@contextlib.contextmanager
def fresh_database(pg_host: str) -> Iterator[str]:
    name = f"oa_bench_{uuid.uuid4().hex[:12]}"
    subprocess.run(
        ["psql", "-h", pg_host, "-d", "postgres", "-qc", f"CREATE DATABASE {name}"],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://{getpass.getuser()}@/{name}?host={pg_host}"
    finally:
        subprocess.run(
            [
                "psql",
                "-h",
                pg_host,
                "-d",
                "postgres",
                "-qc",
                f"DROP DATABASE IF EXISTS {name} WITH (FORCE)",
            ],
            capture_output=True,
        )


@contextlib.contextmanager
def replica_set(
    database_url: str, count: int, endpoints_n: int = STATIC_ENDPOINTS, **extra: str
) -> Iterator[list[Service]]:
    instance = f"brepl-{uuid.uuid4().hex[:10]}"
    endpoints = ",".join(f"http://w{i}.static.invalid:8080" for i in range(endpoints_n))
    env = {
        "PROVIDERS": "static",
        "STATIC_WORKERS": f"renderer={endpoints}",
        "DATABASE_URL": database_url,
        "SCHEDULER_INSTANCE": instance,
        "DOCKER_NETWORK": f"oa-{instance}",
        "RUST_LOG": "warn",
        **extra,
    }
    services = [Service("repl", **env) for _ in range(count)]
    secret = services[0].secret
    for service in services:  # one secret for all, as in production
        service.secret = secret
        service.env["INTERNAL_SECRET"] = secret
    try:
        for service in services:
            service.start()
        yield services
    finally:
        for service in services:
            service.cleanup()


def pgbench(pg_host: str, seconds: float) -> dict[str, float]:
    """pgbench's TPC-B-like load on a scratch database, 32 clients on 2 threads,
    synchronous_commit on: what this server does with 5 statements a transaction."""
    env = {**os.environ, "PGHOST": pg_host, "PGOPTIONS": "-c synchronous_commit=on"}
    with fresh_database(pg_host) as url:
        name = url.split("?")[0].rsplit("/", 1)[1]
        subprocess.run(["pgbench", "-i", "-q", name], check=True, capture_output=True, env=env)
        out = subprocess.run(
            ["pgbench", "-c", "32", "-j", "2", "-T", f"{seconds:g}", name],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        ).stdout
    tps = next(line for line in out.splitlines() if line.startswith("tps"))
    latency = next(line for line in out.splitlines() if line.startswith("latency average"))
    return {
        "tps": float(tps.split("=")[1].split()[0]),
        "latency_ms": float(latency.split("=")[1].split()[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--pg-host", default=os.environ.get("PGHOST", "/var/run/postgresql"))
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--no-pgbench", action="store_true")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    configs = sorted({1, args.replicas})

    results: dict[int, dict[int, dict[str, Any]]] = {}
    for count in configs:
        with contextlib.ExitStack() as stack:
            url = args.database_url or stack.enter_context(fresh_database(args.pg_host))
            services = stack.enter_context(replica_set(url, count))
            urls = [s.url for s in services]
            pids = [s.pid for s in services]
            results[count] = {
                c: load(urls, services[0].secret, c, args.seconds, pids) for c in levels
            }

    reference = None if args.no_pgbench else pgbench(args.pg_host, args.seconds)

    print(
        f"acquire+release round trips on PostgreSQL, {args.seconds:g} s per level, static "
        f"provider with {STATIC_ENDPOINTS} endpoints, clients split between the replicas, "
        f"one load generator process per replica; {os.cpu_count()} CPUs"
    )
    print(
        f"{'clients':>7} {'replicas':>8} {'split':>9} {'rate/s':>9} {'p50 ms':>8} "
        f"{'p99 ms':>8} {'errors':>6} {'CPU ms/round':>12}  each replica"
    )
    for clients in levels:
        for count in configs:
            r = results[count][clients]
            split = "+".join(str(s) for s in r["split"])
            print(
                f"{clients:>7} {count:>8} {split:>9} {r['rate']:>9.1f} {r['p50_ms']:>8.2f} "
                f"{r['p99_ms']:>8.2f} {r['errors']:>6} {r['cpu_ms']:>12.2f}  "
                + " / ".join(f"{c:.2f}" for c in r["cpu_ms_each"])
            )
        if len(configs) > 1:
            ratio = results[configs[-1]][clients]["rate"] / results[1][clients]["rate"]
            print(f"{clients:>7} {'ratio':>8} {'':>9} {ratio:>9.2f}  ({configs[-1]} replicas / 1)")
    if reference is not None:
        print(
            f"reference, same server and run: pgbench TPC-B-like, 32 clients, -j 2, "
            f"{args.seconds:g} s, synchronous_commit on: {reference['tps']:,.0f} tx/s "
            f"(5 statements each), latency average {reference['latency_ms']:.2f} ms"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--generator":
        _, _, url, secret, clients, seconds = sys.argv
        os.environ.pop("HTTP_PROXY", None)
        print(json.dumps(asyncio.run(_generate(url, secret, int(clients), float(seconds)))))
    else:
        main()
