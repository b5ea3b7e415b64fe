#!/usr/bin/env python
"""Cold and warm acquire on Modal (the emulator) beside Docker, in one run (issue 26).

Two schedulers, each with WARM_POOL=renderer/none=1 and readiness probed at /healthz:
one with PROVIDERS=local-docker, one with PROVIDERS=modal against the Modal emulator
(`tests/modal_emulator/`: the official `modal` client over Modal's gRPC protocol, each
sandbox a Docker container of the demo worker behind a TLS tunnel). Per round, on each
in turn:
  cold  one acquire of kind=anim (no pool for anim: a container, or a sandbox, is made
        and probed), then released;
  warm  one acquire of kind=renderer served by the idle pool worker (the hand-off, over
        the tunnel on Modal), then released, and the pool refilled before the next round.
Latency is request sent to answer read. On the emulator a sandbox costs what its Docker
container costs plus the protocol's calls and the tunnel; on Modal itself, add Modal's
own scheduling (seconds): these figures are the scheduler's share.

    .venv/bin/python bench/modal.py [--rounds 10]
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

from tests.modal_emulator import ModalEmulator  # noqa: E402


@contextlib.contextmanager
def schedulers() -> Iterator[dict[str, Service]]:
    network = f"oa-bmodal-{uuid.uuid4().hex[:8]}"
    with ModalEmulator(network=network) as emulator:
        docker = Service("mdock", **COMMON)
        modal = Service(
            "modal",
            PROVIDERS="modal",
            MODAL_RENDERER_IMAGE=WORKER_IMAGE,
            MODAL_ANIM_IMAGE=WORKER_IMAGE,
            **emulator.client_env(),
            **COMMON,
        )
        try:
            yield {"docker": docker.start(), "modal (emulator)": modal.start()}
        finally:
            docker.cleanup()
            modal.cleanup()


if __name__ == "__main__":
    main(__doc__, schedulers)
