"""Run the emulator as its own process:

    python -m tests.modal_emulator --port N --network NAME

Prints one JSON line on stdout once it serves (`server_url` for `MODAL_SERVER_URL`,
`control_url`, `ca_file` for `SSL_CERT_FILE`, `token_id`, `instance`, `network`,
`network_gateway`, and `token_secret` when it made one up), then serves until SIGINT
or SIGTERM, and removes every container it made on the way out. The token pair comes from
`MODAL_EMULATOR_TOKEN_ID` / `MODAL_EMULATOR_TOKEN_SECRET` when set (never from the
command line), else is made up.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.emulator_process import arguments, log_to_stderr, run_until_stopped

from .server import LOOPBACK, EmulatorConfig, serve
from .version import CHECKED_CLIENT_VERSION


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = arguments("tests.modal_emulator", __doc__, "gRPC", "sandboxes")
    parser.add_argument(
        "--tunnel-host",
        default=LOOPBACK,
        help="host in tunnel URLs and in the certificate (default 127.0.0.1)",
    )
    parser.add_argument("--tunnel-bind", default=LOOPBACK, help="address tunnels listen on")
    parser.add_argument(
        "--accept-client-version",
        action="append",
        default=[],
        help=f"also accept this modal client version (checked: {CHECKED_CLIENT_VERSION})",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    log_to_stderr(args.log_level)
    token_id = os.environ.get("MODAL_EMULATOR_TOKEN_ID") or "ak-" + secrets.token_hex(8)
    given_secret = os.environ.get("MODAL_EMULATOR_TOKEN_SECRET")
    token_secret = given_secret or "as-" + secrets.token_hex(16)
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="modal-emulator-"))
    config = EmulatorConfig(
        instance=args.instance or secrets.token_hex(5),
        token_id=token_id,
        token_secret=token_secret,
        state_dir=state_dir,
        network=args.network,
        port=args.port,
        control_port=args.control_port,
        tunnel_host=args.tunnel_host,
        tunnel_bind=args.tunnel_bind,
        client_versions=frozenset({CHECKED_CLIENT_VERSION, *args.accept_client_version}),
    )

    def ready(info: dict[str, Any]) -> None:
        if not given_secret:
            info["token_secret"] = token_secret
        print(json.dumps(info), flush=True)

    run_until_stopped(lambda stop: serve(config, ready, stop), args.exit_with_parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
