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
import os
import secrets
import sys

from tests.emulator_common import LOOPBACK
from tests.emulator_process import arguments, log_to_stderr, print_ready, run_until_stopped

from .server import EmulatorConfig, serve
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
    config = EmulatorConfig.from_arguments(
        args,
        "modal-emulator-",
        token_id=token_id,
        token_secret=token_secret,
        tunnel_host=args.tunnel_host,
        tunnel_bind=args.tunnel_bind,
        client_versions=frozenset({CHECKED_CLIENT_VERSION, *args.accept_client_version}),
    )
    ready = print_ready({} if given_secret else {"token_secret": token_secret})
    run_until_stopped(lambda stop: serve(config, ready, stop), args.exit_with_parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
