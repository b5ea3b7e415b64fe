#!/usr/bin/env python
"""Cold and warm acquire on Kubernetes (the emulator) beside Docker, in one run (issue 27).

Two schedulers, each with WARM_POOL=renderer/none=1 and readiness probed at /healthz:
one with PROVIDERS=local-docker, one with PROVIDERS=kubernetes against the Kubernetes
emulator (`tests/k8s_emulator/`: lightkube over the Kubernetes API through a kubeconfig,
each pod a Docker container of the demo worker started by the emulator's test kubelet).
Per round, on each in turn:
  cold  one acquire of kind=anim (no pool for anim: a container, or a pod and its
        secret, is made, waited for until Running and Ready, and probed), then released;
  warm  one acquire of kind=renderer served by the idle pool worker (the hand-off, at
        the pod's IP on Kubernetes), then released, and the pool refilled before the
        next round.
Latency is request sent to answer read. On the emulator a pod costs what its Docker
container costs plus the API calls (the pod, its secret, a watch of its start); on
a real cluster add its scheduler, the image pull and the kubelet's own start (seconds):
these figures are the scheduler's share.

    .venv/bin/python bench/k8s.py [--rounds 10]
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _cold_warm import COMMON, main  # noqa: E402
from _common import WORKER_IMAGE, Service  # noqa: E402

from tests.k8s_emulator import KubeEmulator  # noqa: E402


@contextlib.contextmanager
def schedulers() -> Iterator[dict[str, Service]]:
    network = f"oa-bk8s-{uuid.uuid4().hex[:8]}"
    with KubeEmulator(network=network) as emulator:
        docker = Service("kdock", **COMMON)
        kube = Service(
            "k8s",
            PROVIDERS="kubernetes",
            KUBECONFIG=str(emulator.kubeconfig_path),
            K8S_RENDERER_IMAGE=WORKER_IMAGE,
            K8S_ANIM_IMAGE=WORKER_IMAGE,
            **COMMON,
        )
        try:
            yield {"docker": docker.start(), "kubernetes (emulator)": kube.start()}
        finally:
            docker.cleanup()
            kube.cleanup()


if __name__ == "__main__":
    main(__doc__, schedulers)
