#!/usr/bin/env python
"""50 concurrent acquires on RunPod (the emulator, 1 s to RUNNING) against one acquire.

Both the RunPod emulator (`python -m tests.runpod_emulator`) and the scheduler
(`python -m openalice_scheduler serve`, PROVIDERS=runpod) run as their own processes on
loopback; this script is only the client. Per round:

  single      `--single` acquires one after another (each released before the next);
              the median is the time of one acquire
  concurrent  `--n` acquires sent at once (one connection each); the wall time runs from
              the first request sent to the last answer received; then all are released

The ratio is wall(concurrent) / median(single). Goal: <= 1.5, i.e. 50 leases cost about
what one does, because the scheduler waits for pods in parallel.

    .venv/bin/python bench/runpod_concurrency.py [--n 50] [--delay 1.0] [--rounds 3]
        [--api rest|graphql] [--gpu mid] [--poll 0.1]

`--poll` is RUNPOD_POLL_INTERVAL_SECONDS (the service's default is 2 s, for real pods that
take minutes); the first look at a new pod comes after min(poll, 0.25) s and the wait
doubles from there, so with 0.1 the measured time is provisioning plus the scheduler's own
cost rather than polling granularity.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
GOAL_RATIO = 1.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """The emulator and the scheduler, started and stopped together."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="oa-bench-runpod-"))
        self.key = "bench-key-" + uuid.uuid4().hex
        self.secret = "bench-secret-" + uuid.uuid4().hex
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.emulator: subprocess.Popen[str] | None = None
        self.scheduler: subprocess.Popen[bytes] | None = None
        self.runpod_url = ""

    def start(self) -> None:
        self.emulator = subprocess.Popen(
            [PYTHON, "-m", "tests.runpod_emulator", "--port", "0", "--api-key", self.key,
             "--provision-delay", str(self.args.delay)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        assert self.emulator.stdout is not None
        self.runpod_url = self.emulator.stdout.readline().strip()
        if not self.runpod_url.startswith("http"):
            raise RuntimeError("the RunPod emulator did not start")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OTEL_", "RUST_LOG", "LOG_LEVEL", "RUNPOD_"))}
        env.update({
            "INTERNAL_SECRET": self.secret,
            "SCHEDULER_HOST": "127.0.0.1",
            "SCHEDULER_PORT": str(self.port),
            "SCHEDULER_INSTANCE": f"bench-{uuid.uuid4().hex[:8]}",
            "DATABASE_URL": f"sqlite:///{self.workdir / 'bench.db'}",
            "PROVIDERS": "runpod",
            "RUNPOD_API": self.args.api,
            "RUNPOD_API_KEY": self.key,
            "RUNPOD_API_BASE_URL": self.runpod_url,
            "RUNPOD_POLL_INTERVAL_SECONDS": str(self.args.poll),
            "RUST_LOG": "warn",
            "PYTHONUNBUFFERED": "1",
        })
        with open(self.workdir / "scheduler.log", "ab") as log:
            self.scheduler = subprocess.Popen(
                [PYTHON, "-m", "openalice_scheduler", "serve"],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.scheduler.poll() is not None:
                raise RuntimeError(f"scheduler exited:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"scheduler not ready:\n{self.log()}")

    def log(self) -> str:
        return (self.workdir / "scheduler.log").read_text(errors="replace")

    def emulator_state(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.runpod_url}/_emulator/state", timeout=30).json())

    def stop(self) -> None:
        for proc in (self.scheduler, self.emulator):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        shutil.rmtree(self.workdir, ignore_errors=True)


async def acquire(client: httpx.AsyncClient, gpu: str) -> tuple[float, str]:
    started = time.perf_counter()
    response = await client.post("/v1/lease", json={"kind": "renderer", "gpu": gpu})
    took = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"acquire answered {response.status_code}: {response.text}")
    return took, str(response.json()["lease"]["lease_id"])


async def release(client: httpx.AsyncClient, lease_id: str) -> None:
    response = await client.delete(f"/v1/lease/{lease_id}")
    if response.status_code != 204:
        raise RuntimeError(f"release answered {response.status_code}: {response.text}")


async def run(procs: Processes, args: argparse.Namespace) -> int:
    limits = httpx.Limits(max_connections=args.n + 10, max_keepalive_connections=args.n + 10)
    async with httpx.AsyncClient(base_url=procs.url, timeout=120, limits=limits,
                                 headers={"X-Internal-Secret": procs.secret}) as client:
        for _ in range(2):  # warm-up: imports, first catalog, connections
            _, lease_id = await acquire(client, args.gpu)
            await release(client, lease_id)
        # Open the connections the burst will use, so the burst measures the scheduler.
        await asyncio.gather(*(client.get("/health") for _ in range(args.n)))

        ratios: list[float] = []
        for round_no in range(1, args.rounds + 1):
            singles = []
            for _ in range(args.single):
                took, lease_id = await acquire(client, args.gpu)
                singles.append(took)
                await release(client, lease_id)
            one = statistics.median(singles)

            started = time.perf_counter()
            results = await asyncio.gather(*(acquire(client, args.gpu) for _ in range(args.n)))
            wall = time.perf_counter() - started
            latencies = sorted(took for took, _ in results)
            live = len(procs.emulator_state()["pods"])
            await asyncio.gather(*(release(client, lease_id) for _, lease_id in results))
            left = len(procs.emulator_state()["pods"])
            ratio = wall / one
            ratios.append(ratio)
            print(f"round {round_no}: one acquire {one:.3f} s (median of {args.single}: "
                  f"{', '.join(f'{s:.3f}' for s in singles)}); {args.n} concurrent: "
                  f"wall {wall:.3f} s, per-request p50 {statistics.median(latencies):.3f} s "
                  f"max {latencies[-1]:.3f} s; pods live {live}, after release {left}; "
                  f"ratio {ratio:.2f}")
            if live != args.n or left != 0:
                print("  pods did not match the leases", file=sys.stderr)
                return 1

    calls = procs.emulator_state()["calls"]
    kinds: dict[str, int] = {}
    for call in calls:
        kinds[call["kind"] or "?"] = kinds.get(call["kind"] or "?", 0) + 1
    verdict = "met" if statistics.median(ratios) <= GOAL_RATIO else "NOT met"
    print(f"RunPod calls over the run: {dict(sorted(kinds.items()))}")
    print(f"ratio wall({args.n} concurrent) / one acquire: median {statistics.median(ratios):.2f} "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); goal <= {GOAL_RATIO}: {verdict}")
    return 0 if verdict == "met" else 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=50, help="concurrent acquires (default 50)")
    parser.add_argument("--delay", type=float, default=1.0,
                        help="emulator seconds from create to RUNNING (default 1.0)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--single", type=int, default=5,
                        help="sequential acquires per round for the one-acquire time")
    parser.add_argument("--api", choices=["rest", "graphql"], default="rest")
    parser.add_argument("--gpu", choices=["none", "entry", "mid", "high"], default="mid")
    parser.add_argument("--poll", type=float, default=0.1,
                        help="RUNPOD_POLL_INTERVAL_SECONDS (default 0.1)")
    args = parser.parse_args()
    if args.api == "graphql" and args.gpu == "none":
        parser.error("gpu=none is a CPU pod, served on REST only")
    procs = Processes(args)
    try:
        procs.start()
        print(f"RunPod emulator {procs.runpod_url} (provisioning {args.delay:g} s, "
              f"api {args.api}), scheduler {procs.url}, gpu={args.gpu}, "
              f"RUNPOD_POLL_INTERVAL_SECONDS={args.poll:g}")
        return asyncio.run(run(procs, args))
    finally:
        procs.stop()


if __name__ == "__main__":
    sys.exit(main())
