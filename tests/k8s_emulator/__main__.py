"""Run the emulator as its own process:

    python -m tests.k8s_emulator --port N --network NAME

Prints one JSON line on stdout once it serves (`server_url`, `control_url`, `ca_file`,
`instance`, `network`, `host_ip`, `user`, and `token` when it made one up), then serves
until SIGINT or SIGTERM, and removes every container it made on the way out. The bearer
token comes from `K8S_EMULATOR_TOKEN` when set (never from the command line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from tests.emulator_process import arguments, log_to_stderr, print_ready, run_until_stopped

from .access import DEFAULT_USER
from .server import EmulatorConfig, serve


def _json_arg(text: str) -> Any:
    return json.loads(Path(text[1:]).read_text() if text.startswith("@") else text)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = arguments("tests.k8s_emulator", __doc__, "HTTPS API", "pods")
    parser.add_argument("--user", default=DEFAULT_USER, help="the token's user (RBAC messages)")
    parser.add_argument(
        "--namespace", action="append", default=[], help="one more namespace (repeatable)"
    )
    parser.add_argument("--nodes", type=_json_arg, default=None, help="JSON list (or @file)")
    parser.add_argument("--rbac", type=_json_arg, default=None, help="Role rules, JSON (or @file)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    log_to_stderr(args.log_level)
    given = os.environ.get("K8S_EMULATOR_TOKEN")
    token = given or secrets.token_urlsafe(24)
    config = EmulatorConfig.from_arguments(
        args,
        "k8s-emulator-",
        token=token,
        user=args.user,
        namespaces=args.namespace,
        nodes=args.nodes,
        rbac=args.rbac,
    )
    ready = print_ready({} if given else {"token": token})
    run_until_stopped(lambda stop: serve(config, ready, stop), args.exit_with_parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
