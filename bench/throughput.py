"""Acquire+release round trips per second through the service with the static provider
(1,000 endpoints), at 1, 8 and 32 concurrent clients, from a load generator in a second
process; p50 and p99 latency of one round trip. In the same run, when `etcd` is installed
(Debian `etcd-server`), the same load shape against a single-node etcd's lease grant +
revoke on its JSON gateway, and the ratio of the two rates. For each system also the CPU
time its server used per round trip and the cores it kept busy (from /proc; for the
scheduler, its process and any it starts): the scheduler runs its
event loop on one core, etcd on several.

    .venv/bin/python bench/throughput.py [--seconds 10] [--clients 1,8,32]
                                         [--database-url postgresql://...]

Both sides are durable: the scheduler commits to SQLite (WAL, synchronous=FULL) or the
given PostgreSQL; etcd fsyncs its WAL. Traffic stays on 127.0.0.1; every run is bounded
by --seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    HttpConnection,
    Service,
    cpu_seconds,
    drive,
    free_port,
    lease_round,
    percentile,
    process_tree,
)

STATIC_ENDPOINTS = 1000
GRANT_BODY = json.dumps({"TTL": 600}).encode()


def load(
    url: str, headers: dict[str, str], shape: str, clients: int, seconds: float, server_pid: int
) -> dict:
    """Run the load generator in a second process; returns its JSON result, with the CPU
    time the server used meanwhile per round trip (`cpu_ms`) and in cores: its process
    and the ones it started."""
    pids = process_tree(server_pid)
    before = cpu_seconds(pids)
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--generator",
            url,
            json.dumps(headers),
            shape,
            str(clients),
            str(seconds),
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{out.stderr[-3000:]}")
    used = cpu_seconds(pids) - before
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["cpu_ms"] = used / max(result["rounds"], 1) * 1000
    result["cores"] = used / seconds
    return result


# --- the load generator (second process) ---------------------------------------------


async def _generate(
    url: str, headers: dict[str, str], shape: str, clients: int, seconds: float
) -> dict[str, Any]:
    async def etcd_round(http: HttpConnection) -> bool:
        status, body = await http.request("POST", "/v3/lease/grant", GRANT_BODY)
        if status != 200:
            return False
        revoke = json.dumps({"ID": json.loads(body)["ID"]}).encode()
        return (await http.request("POST", "/v3/lease/revoke", revoke))[0] == 200

    round_trip = lease_round if shape == "scheduler" else etcd_round
    latencies, errors, elapsed = await drive(
        int(url.rsplit(":", 1)[1]), headers, clients, seconds, round_trip
    )
    return {
        "rate": len(latencies) / elapsed,
        "p50_ms": percentile(latencies, 50) * 1000 if latencies else None,
        "p99_ms": percentile(latencies, 99) * 1000 if latencies else None,
        "rounds": len(latencies),
        "errors": errors,
    }


# --- etcd ----------------------------------------------------------------------------


class Etcd:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="oa-bench-etcd-"))
        self.port, self.peer = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> Etcd:
        import httpx

        self.proc = subprocess.Popen(
            [
                "etcd",
                "--data-dir",
                str(self.dir / "data"),
                "--name",
                "bench",
                "--listen-client-urls",
                self.url,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{self.peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{self.peer}",
                "--initial-cluster",
                f"bench=http://127.0.0.1:{self.peer}",
                "--log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "etcd.log", "wb"),  # noqa: SIM115
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("etcd did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--database-url", default=None)
    parser.add_argument("--label", default=None, help="name for the scheduler column")
    args = parser.parse_args()
    # Results are kept per level: a level given twice is measured once.
    levels = list(dict.fromkeys(int(c) for c in args.clients.split(",")))

    endpoints = ",".join(f"http://w{i}.static.invalid:8080" for i in range(STATIC_ENDPOINTS))
    env = {"PROVIDERS": "static", "STATIC_WORKERS": f"renderer={endpoints}", "RUST_LOG": "warn"}
    if args.database_url:
        env["DATABASE_URL"] = args.database_url
    label = args.label or ("postgresql" if args.database_url else "sqlite")
    results: dict[str, dict[int, dict]] = {label: {}}
    with Service("tput", **env).start() as service:
        headers = {"X-Internal-Secret": service.secret}
        for clients in levels:
            results[label][clients] = load(
                service.url, headers, "scheduler", clients, args.seconds, service.pid
            )
    etcd_bin = shutil.which("etcd")
    if etcd_bin:
        etcd = Etcd().start()
        try:
            results["etcd"] = {
                c: load(etcd.url, {}, "etcd", c, args.seconds, etcd.pid) for c in levels
            }
        finally:
            etcd.stop()
    else:
        print("etcd not installed (apt-get install etcd-server): no comparison", file=sys.stderr)

    print(
        f"acquire+release round trips, {args.seconds:g} s per level, static provider with "
        f"{STATIC_ENDPOINTS} endpoints, load from a second process"
    )
    print(
        f"{'clients':>7} {'system':>12} {'rate/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}"
        f" {'cpu ms/rt':>9} {'cores':>5}"
    )
    for clients in levels:
        for system, by_level in results.items():
            r = by_level[clients]
            print(
                f"{clients:>7} {system:>12} {r['rate']:>9.1f} {r['p50_ms']:>8.2f} "
                f"{r['p99_ms']:>8.2f} {r['errors']:>6} {r['cpu_ms']:>9.3f} {r['cores']:>5.2f}"
            )
        if "etcd" in results:
            ratio = results[label][clients]["rate"] / results["etcd"][clients]["rate"]
            print(f"{clients:>7} {'ratio':>12} {ratio:>9.2f}  ({label} / etcd; goal >= 1.0 at 32)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--generator":
        _, _, url, headers, shape, clients, seconds = sys.argv
        os.environ.pop("HTTP_PROXY", None)
        print(
            json.dumps(
                asyncio.run(
                    _generate(url, json.loads(headers), shape, int(clients), float(seconds))
                )
            )
        )
    else:
        main()
