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
what one does, because the scheduler waits for pods in parallel. Each round also times the
same burst with pods that run at once (provisioning 0 s): the scheduler's and emulator's
own cost, which the concurrent wall time is about the provisioning delay plus.

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
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import HttpConnection, free_port  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
GOAL_RATIO = 1.5


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
            [
                PYTHON,
                "-m",
                "tests.runpod_emulator",
                "--port",
                "0",
                "--api-key",
                self.key,
                "--provision-delay",
                str(self.args.delay),
                "--pods-answer-after",
                "0",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.emulator.stdout is not None
        self.runpod_url = self.emulator.stdout.readline().strip()
        if not self.runpod_url.startswith("http"):
            raise RuntimeError("the RunPod emulator did not start")
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("OTEL_", "RUST_LOG", "LOG_LEVEL", "RUNPOD_"))
        }
        env.update(
            {
                "INTERNAL_SECRET": self.secret,
                "SCHEDULER_HOST": "127.0.0.1",
                "SCHEDULER_PORT": str(self.port),
                "SCHEDULER_INSTANCE": f"bench-{uuid.uuid4().hex[:8]}",
                "DATABASE_URL": f"sqlite:///{self.workdir / 'bench.db'}",
                "PROVIDERS": "runpod",
                "RUNPOD_API": self.args.api,
                "RUNPOD_API_KEY": self.key,
                "RUNPOD_API_BASE_URL": self.runpod_url,
                # Pods are probed at their proxy URL, which the emulator answers once RUNNING.
                "RUNPOD_PROXY_URL": self.runpod_url + "/_proxy/{pod_id}-{port}",
                "RUNPOD_POLL_INTERVAL_SECONDS": str(self.args.poll),
                "RUST_LOG": "warn",
                "PYTHONUNBUFFERED": "1",
            }
        )
        with open(self.workdir / "scheduler.log", "ab") as log:
            self.scheduler = subprocess.Popen(
                [PYTHON, "-m", "openalice_scheduler", "serve"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
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


async def acquire(conn: HttpConnection, gpu: str) -> tuple[float, str]:
    started = time.perf_counter()
    status, body = await conn.request(
        "POST", "/v1/lease", json.dumps({"kind": "renderer", "gpu": gpu}).encode()
    )
    took = time.perf_counter() - started
    if status != 200:
        raise RuntimeError(f"acquire answered {status}: {body.decode(errors='replace')}")
    return took, str(json.loads(body)["lease"]["lease_id"])


async def release(conn: HttpConnection, lease_id: str) -> None:
    status, body = await conn.request("DELETE", f"/v1/lease/{lease_id}")
    if status != 204:
        raise RuntimeError(f"release answered {status}: {body.decode(errors='replace')}")


async def burst_without_provisioning(
    procs: Processes, conns: list[HttpConnection], args: argparse.Namespace
) -> float:
    """The same burst with pods RUNNING at once: what the scheduler (and the emulator)
    cost on their own. Wall(concurrent) is about the provisioning delay plus this."""
    httpx.post(f"{procs.runpod_url}/_emulator/faults", json={"provision_delay": 0}, timeout=30)
    try:
        await asyncio.gather(*(c.request("GET", "/health") for c in conns))
        started = time.perf_counter()
        results = await asyncio.gather(*(acquire(c, args.gpu) for c in conns))
        wall = time.perf_counter() - started
        await asyncio.gather(
            *(release(c, lease_id) for c, (_, lease_id) in zip(conns, results, strict=True))
        )
    finally:
        httpx.post(
            f"{procs.runpod_url}/_emulator/faults", json={"provision_delay": args.delay}, timeout=30
        )
    return wall


async def run(procs: Processes, args: argparse.Namespace) -> int:
    conns = [HttpConnection(procs.port, {"X-Internal-Secret": procs.secret}) for _ in range(args.n)]
    one_conn = conns[0]
    try:
        for _ in range(2):  # warm-up: imports, first catalog, connections
            _, lease_id = await acquire(one_conn, args.gpu)
            await release(one_conn, lease_id)

        ratios: list[float] = []
        for round_no in range(1, args.rounds + 1):
            singles = []
            for _ in range(args.single):
                took, lease_id = await acquire(one_conn, args.gpu)
                singles.append(took)
                await release(one_conn, lease_id)
            one = statistics.median(singles)
            # Open the connections the burst uses, so that it measures the scheduler.
            await asyncio.gather(*(c.request("GET", "/health") for c in conns))

            started = time.perf_counter()
            results = await asyncio.gather(*(acquire(c, args.gpu) for c in conns))
            wall = time.perf_counter() - started
            latencies = sorted(took for took, _ in results)
            live = len(procs.emulator_state()["pods"])
            await asyncio.gather(
                *(release(c, lease_id) for c, (_, lease_id) in zip(conns, results, strict=True))
            )
            left = len(procs.emulator_state()["pods"])
            ratio = wall / one
            ratios.append(ratio)
            floor = await burst_without_provisioning(procs, conns, args)
            print(
                f"round {round_no}: one acquire {one:.3f} s (median of {args.single}: "
                f"{', '.join(f'{s:.3f}' for s in singles)}); {args.n} concurrent: "
                f"wall {wall:.3f} s, per-request p50 {statistics.median(latencies):.3f} s "
                f"max {latencies[-1]:.3f} s; pods live {live}, after release {left}; "
                f"ratio {ratio:.2f}; same burst with 0 s provisioning {floor:.3f} s; "
                f"load average {os.getloadavg()[0]:.1f}"
            )
            if live != args.n or left != 0:
                print("  pods did not match the leases", file=sys.stderr)
                return 1
    finally:
        for conn in conns:
            await conn.close()

    calls = procs.emulator_state()["calls"]
    kinds: dict[str, int] = {}
    for call in calls:
        kinds[call["kind"] or "?"] = kinds.get(call["kind"] or "?", 0) + 1
    verdict = "met" if statistics.median(ratios) <= GOAL_RATIO else "NOT met"
    print(f"RunPod calls over the run: {dict(sorted(kinds.items()))}")
    print(
        f"ratio wall({args.n} concurrent) / one acquire: median {statistics.median(ratios):.2f} "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); goal <= {GOAL_RATIO}: {verdict}"
    )
    return 0 if verdict == "met" else 2


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, default=50, help="concurrent acquires (default 50)")
    parser.add_argument(
        "--delay",
        type=float,
        default=1.0,
        help="emulator seconds from create to RUNNING (default 1.0)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument(
        "--single",
        type=int,
        default=5,
        help="sequential acquires per round for the one-acquire time",
    )
    parser.add_argument("--api", choices=["rest", "graphql"], default="rest")
    parser.add_argument("--gpu", choices=["none", "entry", "mid", "high"], default="mid")
    parser.add_argument(
        "--poll", type=float, default=0.1, help="RUNPOD_POLL_INTERVAL_SECONDS (default 0.1)"
    )
    args = parser.parse_args()
    if args.api == "graphql" and args.gpu == "none":
        parser.error("gpu=none is a CPU pod, served on REST only")
    procs = Processes(args)
    try:
        procs.start()
        print(
            f"RunPod emulator {procs.runpod_url} (provisioning {args.delay:g} s, "
            f"api {args.api}), scheduler {procs.url}, gpu={args.gpu}, "
            f"RUNPOD_POLL_INTERVAL_SECONDS={args.poll:g}"
        )
        return asyncio.run(run(procs, args))
    finally:
        procs.stop()


if __name__ == "__main__":
    sys.exit(main())
