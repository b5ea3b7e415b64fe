"""What the client commands share: their options, a session whose errors become a
message and an exit code, and output to the terminal."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from pydantic import BaseModel

from openalice_scheduler.client import RetryPolicy, SchedulerClient, SchedulerUnreachable
from openalice_scheduler.errors import NoProviderAvailable, SchedulerError

if TYPE_CHECKING:
    from rich.console import Console


class ExitCode(IntEnum):
    """What scripts can rely on; documented in `--help` and docs/reference/client.md#exit-codes."""

    ok = 0
    error = 1  # anything else: 409 still provisioning, 500, an unexpected answer
    usage = 2  # bad options, INTERNAL_SECRET unset, or the request refused (422, 413)
    not_found = 3  # 404: no such lease, or it has ended
    denied = 4  # 401 wrong secret, 403 X-Lease-Owner missing or different
    unavailable = 5  # 503: no capacity (after --wait), or the service cannot be reached
    provider_failed = 6  # 502: provisioning failed everywhere (or a release is being retried)
    quota = 7  # 429: the owner holds as many leases as it may


EXIT_CODES_HELP = (
    "Talks to the scheduler at --url (env SCHEDULER_URL, default http://localhost:8080) "
    "with the secret from env INTERNAL_SECRET.\n\n"
    "Exit codes: 0 ok; 1 other error; 2 usage (bad options, INTERNAL_SECRET unset, 422, 413); "
    "3 lease not found (404); 4 unauthorized or forbidden (401/403); "
    "5 no capacity or scheduler unavailable/unreachable (503); "
    "6 provision failed (502); 7 owner quota reached (429)."
)

Url = Annotated[
    str, typer.Option("--url", envvar="SCHEDULER_URL", help="Base URL of the scheduler.")
]


class Output(StrEnum):
    table = "table"
    wide = "wide"
    json = "json"


Shown = Annotated[
    Output | None,
    typer.Option(
        "--output",
        "-o",
        help="table (the default), wide (a table with more columns) or json "
        "(for scripts; errors then go to stderr as JSON too).",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="The same as -o json.")]
Owner = Annotated[
    str | None,
    typer.Option("--owner", help="Sent as X-Lease-Owner: needed when the lease has an owner_id."),
]


def die(message: str) -> NoReturn:
    for line in message.splitlines():
        typer.echo(f"openalice-scheduler: {line}", err=True)
    raise SystemExit(2)


def output_of(output: Output | None, as_json: bool) -> Output:
    if as_json and output not in (None, Output.json):
        raise typer.BadParameter(
            f"--json and -o {output.value} disagree; give one", param_hint="--output"
        )
    return Output.json if as_json else output or Output.table


@contextmanager
def session(url: str, shown: Output, retry: RetryPolicy | None = None) -> Iterator[SchedulerClient]:
    """A client for the command; its errors become a message and an exit code."""
    if not os.environ.get("INTERNAL_SECRET"):
        die("INTERNAL_SECRET is not set: export the scheduler's secret")
    _route_client_logs(shown)
    try:
        client = SchedulerClient(url, retry=retry)
    except ValueError as exc:  # a malformed --url
        die(str(exc))
    try:
        yield client
    except SchedulerError as exc:
        _report(exc, shown is Output.json)
        raise typer.Exit(exit_code(exc)) from None
    finally:
        client.close()


def _route_client_logs(shown: Output) -> None:
    """The client's warnings (an acquire retried) as one line each on stderr; none with
    -o json, whose stderr is the JSON error alone. Left to Python's last-resort handler
    they would print bare, with stamina's own line ("stamina.retry_scheduled", its
    details in fields no handler here shows) beside each."""
    for name in ("stamina", "openalice_scheduler.client"):
        logger = logging.getLogger(name)
        logger.propagate = False
        logger.addHandler(logging.NullHandler())
    if shown is not Output.json:
        logging.getLogger("openalice_scheduler.client").addHandler(_StderrLines())


class _StderrLines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        typer.echo(f"openalice-scheduler: {record.getMessage()}", err=True)


def exit_code(exc: SchedulerError) -> ExitCode:
    by_status = {
        401: ExitCode.denied,
        403: ExitCode.denied,
        404: ExitCode.not_found,
        413: ExitCode.usage,
        422: ExitCode.usage,
        429: ExitCode.quota,
        502: ExitCode.provider_failed,
        503: ExitCode.unavailable,
    }
    return by_status.get(exc.status, ExitCode.error)


def _report(exc: SchedulerError, as_json: bool) -> None:
    from rich.markup import escape

    retry_after = exc.retry_after if isinstance(exc, NoProviderAvailable) else None
    if as_json:
        body = {**exc.body(), "status": exc.status}
        if retry_after is not None:
            body["retry_after"] = retry_after
        sys.stderr.write(json.dumps(body) + "\n")
        return
    err = stderr()
    # No HTTP answer at all is not an HTTP status, whatever exit code it shares.
    status = "" if isinstance(exc, SchedulerUnreachable) else f" (HTTP {exc.status})"
    err.print(f"[bold red]error[/] {exc.code}{status}: {escape(exc.message)}", soft_wrap=True)
    if retry_after is not None:
        err.print(f"retry after {retry_after} s")


def print_json(data: BaseModel | list[Any] | dict[str, Any]) -> None:
    def plain(item: Any) -> Any:
        return item.model_dump(mode="json") if isinstance(item, BaseModel) else item

    value = [plain(item) for item in data] if isinstance(data, list) else plain(data)
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def stdout() -> Console:
    from rich.console import Console

    # Piped into grep or a file, a table keeps one row per line, however wide.
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=4096 if wide else None)


def stderr() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False)
