"""`openalice-scheduler`: run the service (`serve`), or talk to a running one (`lease …`,
`providers`, `usage`) with the client in `client/`. Importing this package imports only the
client's dependencies (httpx, pydantic, typer, rich, stamina): the client commands, `--help`
and shell completion work on a client-only install; `serve` imports the server's.

`common.py` holds what every client command shares (options, the session, output, exit
codes); `leases.py` the `lease …` and `providers` commands, `usage.py` the `usage` one."""

from __future__ import annotations

import importlib
import os
from typing import Annotated

import typer

from openalice_scheduler import package_version
from openalice_scheduler.cli.common import EXIT_CODES_HELP, die
from openalice_scheduler.cli.leases import lease_app, providers
from openalice_scheduler.cli.usage import usage

app = typer.Typer(
    name="openalice-scheduler",
    help="GPU/compute lease service for renderer and anim workers.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, …)
    pretty_exceptions_show_locals=False,  # locals would show the secret
    epilog="Exit codes of `lease` and `providers`: see their --help.",
)


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"openalice-scheduler {package_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """GPU/compute lease service for renderer and anim workers."""


@app.command()
def serve() -> None:
    """Run the service. Configured only by environment variables
    (docs/reference/configuration.md)."""
    _run_server_part("server", "serve")


@app.command()
def guard() -> None:
    """Run a guard: destroys this instance's workers past their lease once no scheduler
    answers it (docs/concepts/guard.md#the-guard). Configured by environment variables."""
    _run_server_part("guard", "run")


def _run_server_part(module: str, function: str) -> None:
    """`openalice_scheduler.<module>.<function>(settings)` with the settings from the
    environment. A client-only install, and every start-up error (one line per reason,
    startup.py), is said in lines of its own, exit 2."""
    try:
        target = getattr(importlib.import_module(f"openalice_scheduler.{module}"), function)
        from openalice_scheduler import startup
    except ModuleNotFoundError as exc:  # a client-only install
        die(
            f"the server is not installed ({exc.name} is missing): "
            "pip install 'openalice-scheduler[server]'"
        )
    from openalice_scheduler.errors import StartupError

    try:
        target(startup.load_settings(os.environ))
    except StartupError as exc:
        die(str(exc))


app.command(epilog=EXIT_CODES_HELP)(providers)
app.add_typer(lease_app, name="lease")
app.command(epilog=EXIT_CODES_HELP)(usage)


def main() -> None:
    app(prog_name="openalice-scheduler")
