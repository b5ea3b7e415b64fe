"""Run the emulator as its own process: `python -m tests.runpod_emulator --port N --api-key K`.

Prints the base URL on the first line of stdout (so a parent can read it, also with
`--port 0`), then serves until SIGINT or SIGTERM. Faults are set over HTTP at
`POST /_emulator/faults`.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from .server import RunPodEmulator


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.runpod_emulator", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0 = any free)")
    parser.add_argument("--api-key", required=True, help="the bearer key callers must send")
    parser.add_argument(
        "--provision-delay",
        type=float,
        default=0.0,
        help="seconds from create to RUNNING (default 0)",
    )
    parser.add_argument(
        "--pods-answer-after",
        type=float,
        default=None,
        help="seconds after RUNNING from which a pod's proxy URL (<base URL>/_proxy/"
        "{pod_id}-{port}) answers 200 (default: never, 502)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    stop = threading.Event()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    with RunPodEmulator(args.api_key, port=args.port, provision_delay=args.provision_delay) as emu:
        emu.pods_answer_after = args.pods_answer_after
        print(emu.base_url, flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
