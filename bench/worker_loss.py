#!/usr/bin/env python
"""From a worker's death to its lease ending, per backend, in one run (issue 33).

One scheduler per backend; per round, one lease is acquired, its worker is made to die,
and the time from the death to the moment `GET /v1/lease/{id}` shows it `released`
(`lost`) is measured (the bench reads the lease every 10 ms: up to 10 ms of each figure
is the bench's own polling).

  docker          `docker kill` of the container; heard from the engine's event stream.
                  Reference, in the same run: the same engine's own report of the death
                  to another subscriber (`docker events`, the Docker CLI).
  kubernetes      the worker exits (`GET /cgi-bin/exit`, at its pod's IP) on the
                  Kubernetes emulator; heard from the scheduler's pod watch. Reference:
                  the emulator's own report, a lightkube watch of the pod by the bench.
  modal, runpod   the worker exits (through its Modal tunnel) / RunPod reports its pod
                  EXITED, on the emulators; found by the reconciler's listing, every
                  RECONCILE_INTERVAL_SECONDS (`--interval`, 5 s here; 60 s by default):
                  the bound is that interval plus a listing.

    .venv/bin/python bench/worker_loss.py [--rounds 5] [--interval 5]
"""

from __future__ import annotations

import argparse
import contextlib
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import WORKER_IMAGE, Service, docker_client, summary  # noqa: E402

from tests.k8s_emulator import KubeEmulator  # noqa: E402
from tests.modal_emulator import ModalEmulator  # noqa: E402
from tests.runpod_emulator import RunPodEmulator  # noqa: E402

POLL_S = 0.01
STREAM_ONLY = {"RECONCILE_INTERVAL_SECONDS": "3600"}
# Makes the lease's worker die: returns when (perf_counter) it did, and a function that
# returns when the reference heard of it (None: no reference).
Kill = Callable[[dict[str, Any]], tuple[float, Callable[[], float | None]]]


def ended_after(service: Service, lease: dict[str, Any], since: float) -> float:
    """Seconds from `since` (perf_counter) until the lease reads `released`."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        now = service.http.get(f"/v1/lease/{lease['lease_id']}").json()
        if now["state"] == "released":
            if now["release_reason"] != "lost":
                raise RuntimeError(f"lease ended {now['release_reason']}, not lost")
            return time.perf_counter() - since
        time.sleep(POLL_S)
    raise RuntimeError("the lease did not end within 300 s")


def rounds(service: Service, kill: Kill, n: int, **body: Any) -> tuple[list[float], list[float]]:
    """Per round: the time to the lease's end, and the reference's (when it has one)."""
    took, reference = [], []
    for _ in range(n):
        answer = service.http.post("/v1/lease", json={"kind": "renderer", **body})
        if answer.status_code != 200:
            raise RuntimeError(f"acquire answered {answer.status_code}: {answer.text}")
        lease = answer.json()["lease"]
        started, heard = kill(lease)
        took.append(ended_after(service, lease, started))
        if (seen := heard()) is not None:
            reference.append(seen - started)
    return took, reference


# --- Docker --------------------------------------------------------------------------


def docker_kill(lease: dict[str, Any]) -> tuple[float, Callable[[], float | None]]:
    token = lease["provider_token"]
    events = subprocess.Popen(
        ["docker", "events", "--filter", f"container={token}", "--filter", "event=die"],
        stdout=subprocess.PIPE,
        text=True,
    )
    seen: list[float] = []

    def read() -> None:
        assert events.stdout is not None
        if events.stdout.readline():
            seen.append(time.perf_counter())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)  # the CLI subscribed (it says nothing when it is)
    container = docker_client().containers.get(token)
    started = time.perf_counter()
    container.kill()

    def heard() -> float | None:
        reader.join(30)
        events.kill()
        return seen[0] if seen else None

    return started, heard


# --- Kubernetes -------------------------------------------------------------------------


def k8s_exit(kube: KubeEmulator) -> Kill:
    from lightkube import Client, KubeConfig
    from lightkube.resources.core_v1 import Pod

    client = Client(KubeConfig.from_file(kube.kubeconfig_path), trust_env=False)

    def kill(lease: dict[str, Any]) -> tuple[float, Callable[[], float | None]]:
        seen: list[float] = []
        ready = threading.Event()

        def watch() -> None:
            name = lease["provider_token"]
            version = client.get(Pod, name, namespace="openalice").metadata.resourceVersion
            ready.set()
            for _, pod in client.watch(
                Pod, namespace="openalice", fields={"metadata.name": name}, resource_version=version
            ):
                statuses = (pod.status.containerStatuses or []) if pod.status else []
                if any(s.state and s.state.terminated for s in statuses):
                    seen.append(time.perf_counter())
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        ready.wait(30)
        started = time.perf_counter()
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(lease["endpoint"] + "/cgi-bin/exit?1", timeout=10)

        def heard() -> float | None:
            watcher.join(30)
            return seen[0] if seen else None

        return started, heard

    return kill


# --- Modal, RunPod ---------------------------------------------------------------------


def modal_exit(modal: ModalEmulator) -> Kill:
    trust = ssl.create_default_context(cafile=modal.ca_file)

    def kill(lease: dict[str, Any]) -> tuple[float, Callable[[], float | None]]:
        started = time.perf_counter()
        with contextlib.suppress(httpx.HTTPError):
            httpx.get(lease["endpoint"] + "/cgi-bin/exit?1", verify=trust, timeout=10)
        return started, lambda: None

    return kill


def runpod_exit(runpod: RunPodEmulator) -> Kill:
    def kill(lease: dict[str, Any]) -> tuple[float, Callable[[], float | None]]:
        started = time.perf_counter()
        runpod.set_pod_status(lease["provider_token"], "EXITED")
        return started, lambda: None

    return kill


@contextlib.contextmanager
def started(service: Service) -> Iterator[Service]:
    try:
        yield service.start()
    finally:
        service.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--interval", type=float, default=5.0, help="RECONCILE_INTERVAL_SECONDS")
    args = parser.parse_args()
    listing = {"RECONCILE_INTERVAL_SECONDS": f"{args.interval:g}"}
    rows: list[tuple[str, str, list[float], list[float], str]] = []
    network = f"oa-bloss-{uuid.uuid4().hex[:8]}"

    with started(Service("ldock", **STREAM_ONLY)) as docker:
        took, ref = rounds(docker, docker_kill, args.rounds)
        rows.append(("docker", "event stream", took, ref, "docker events (CLI)"))

    with (
        KubeEmulator(network=network + "k") as kube,
        started(
            Service(
                "lk8s",
                PROVIDERS="kubernetes",
                KUBECONFIG=str(kube.kubeconfig_path),
                K8S_RENDERER_IMAGE=WORKER_IMAGE,
                **STREAM_ONLY,
            )
        ) as k8s,
    ):
        took, ref = rounds(k8s, k8s_exit(kube), args.rounds)
        rows.append(("kubernetes (emulator)", "pod watch", took, ref, "a watch of the pod"))

    with (
        ModalEmulator(network=network + "m") as modal,
        started(
            Service(
                "lmodal",
                PROVIDERS="modal",
                MODAL_RENDERER_IMAGE=WORKER_IMAGE,
                **modal.client_env(),
                **listing,
            )
        ) as on_modal,
    ):
        took, _ = rounds(on_modal, modal_exit(modal), args.rounds)
        rows.append(("modal (emulator)", "listing", took, [], f"interval {args.interval:g} s"))

    with (
        RunPodEmulator(api_key="bench-key") as runpod,
        started(
            Service(
                "lrunpod",
                PROVIDERS="runpod",
                RUNPOD_API_KEY="bench-key",
                RUNPOD_API_BASE_URL=runpod.base_url,
                RUNPOD_READY_TIMEOUT_SECONDS="0",
                RUNPOD_POLL_INTERVAL_SECONDS="0.1",
                **listing,
            )
        ) as on_runpod,
    ):
        took, _ = rounds(on_runpod, runpod_exit(runpod), args.rounds, gpu="entry")
        rows.append(("runpod (emulator)", "listing", took, [], f"interval {args.interval:g} s"))

    print(f"death -> lease ended, {args.rounds} rounds each (ms; reference in the same run)")
    print(f"{'backend':24} {'heard by':14} {'p50':>8} {'max':>8}   reference")
    for name, how, took, ref, what in rows:
        figures = summary(took)
        shown = (
            f"{what}: p50 {summary(ref)['p50'] * 1000:.0f} ms, max {summary(ref)['max'] * 1000:.0f}"
            if ref
            else what
        )
        print(
            f"{name:24} {how:14} {figures['p50'] * 1000:8.0f} {figures['max'] * 1000:8.0f}   "
            f"{shown}"
        )


if __name__ == "__main__":
    main()
