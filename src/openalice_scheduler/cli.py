"""`openalice-scheduler`: run the service (`serve`), or talk to a running one (`lease …`,
`providers`) with the client in `client/`. Importing this module imports only the
client's dependencies (httpx, pydantic, typer, rich, stamina): the client commands, `--help`
and shell completion work on a client-only install; `serve` imports the server's."""

from __future__ import annotations

import importlib
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

from openalice_scheduler import package_version
from openalice_scheduler.client import (
    DEFAULT_URL,
    RetryPolicy,
    SchedulerClient,
    SchedulerUnreachable,
)
from openalice_scheduler.errors import NoProviderAvailable, SchedulerError
from openalice_scheduler.models import (
    GpuClass,
    GpuUse,
    Lease,
    LeaseState,
    ProviderView,
    WorkerKind,
)

if TYPE_CHECKING:
    from rich.console import Console


class ExitCode(IntEnum):
    """What scripts can rely on; documented in `--help` and the README."""

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

app = typer.Typer(
    name="openalice-scheduler",
    help="GPU/compute lease service for renderer and anim workers.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, …)
    pretty_exceptions_show_locals=False,  # locals would show the secret
    epilog="Exit codes of `lease` and `providers`: see their --help.",
)
lease_app = typer.Typer(
    help="Acquire, inspect, renew and release leases on a running scheduler.",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
)
app.add_typer(lease_app, name="lease")

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
    """Run the service. Configured only by environment variables (see README)."""
    _run_server_part("server", "serve")


@app.command()
def guard() -> None:
    """Run a guard: destroys this instance's workers past their lease once no scheduler
    answers it (README, The guard). Configured by environment variables."""
    _run_server_part("guard", "run")


def _run_server_part(module: str, function: str) -> None:
    """`openalice_scheduler.<module>.<function>(settings)` with the settings from the
    environment. A client-only install, and every start-up error (one line per reason,
    startup.py), is said in lines of its own, exit 2."""
    try:
        target = getattr(importlib.import_module(f"openalice_scheduler.{module}"), function)
        from openalice_scheduler import startup
    except ModuleNotFoundError as exc:  # a client-only install
        _die(
            f"the server is not installed ({exc.name} is missing): "
            "pip install 'openalice-scheduler[server]'"
        )
    from openalice_scheduler.errors import StartupError

    try:
        target(startup.load_settings(os.environ))
    except StartupError as exc:
        _die(str(exc))


@app.command(epilog=EXIT_CODES_HELP)
def providers(url: Url = DEFAULT_URL, output: Shown = None, as_json: AsJson = False) -> None:
    """Providers: health, capacity and use per GPU class (wide: per worker kind too)."""
    shown = _output(output, as_json)
    with _session(url, shown) as client:
        found = client.providers()
    if shown is Output.json:
        _print_json(found)
    else:
        _stdout().print(_providers_table(found, wide=shown is Output.wide))


@lease_app.command("acquire", epilog=EXIT_CODES_HELP)
def lease_acquire(
    kind: Annotated[WorkerKind, typer.Option("--kind", help="Worker kind.")],
    gpu: Annotated[GpuClass, typer.Option("--gpu", help="GPU class.")] = GpuClass.none,
    ttl: Annotated[int, typer.Option("--ttl", help="Lease TTL in seconds (1..28800).")] = 3600,
    owner: Annotated[
        str | None,
        typer.Option("--owner", help="owner_id: renew and release then need --owner with it."),
    ] = None,
    correlation_id: Annotated[
        str | None,
        typer.Option(
            "--correlation-id",
            help="Carried into logs and traces; with --owner, repeating "
            "the same request returns the same lease.",
        ),
    ] = None,
    region: Annotated[str | None, typer.Option("--region", help="Region to place in.")] = None,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", metavar="KEY=VALUE", help="Worker environment; repeatable."),
    ] = None,
    wait: Annotated[
        int,
        typer.Option("--wait", help="Seconds to wait in line when no provider has capacity now."),
    ] = 0,
    retry_timeout: Annotated[
        float,
        typer.Option(
            "--retry-timeout",
            min=0,
            help="With --owner and --correlation-id: how long to keep "
            "retrying while the scheduler is unreachable or its store unavailable (0: never).",
        ),
    ] = RetryPolicy().timeout,
    url: Url = DEFAULT_URL,
    output: Shown = None,
    as_json: AsJson = False,
) -> None:
    """Acquire a worker and print its lease (endpoint, expiry). With --owner and
    --correlation-id, retried while the scheduler is unreachable or its store unavailable."""
    shown = _output(output, as_json)
    worker_env = _parse_env(env or [])
    retry = RetryPolicy(timeout=retry_timeout) if retry_timeout > 0 else None
    with (
        _session(url, shown, retry) as client,
        _stderr().status(f"Acquiring a worker (kind={kind.value}, gpu={gpu.value})…"),
    ):
        lease = client.acquire(
            kind,
            gpu=gpu,
            ttl_seconds=ttl,
            owner_id=owner,
            correlation_id=correlation_id,
            region=region,
            env=worker_env,
            wait_seconds=wait,
        )
    _show_lease(lease, shown)


@lease_app.command("get", epilog=EXIT_CODES_HELP)
def lease_get(
    lease_id: Annotated[str, typer.Argument(help="The lease's id.")],
    url: Url = DEFAULT_URL,
    output: Shown = None,
    as_json: AsJson = False,
) -> None:
    """Look a lease up, in any state."""
    shown = _output(output, as_json)
    with _session(url, shown) as client:
        lease = client.get(lease_id)
    _show_lease(lease, shown)


@lease_app.command("ls", epilog=EXIT_CODES_HELP)
def lease_ls(
    state: Annotated[
        list[LeaseState] | None,
        typer.Option("--state", help="Only leases in this state; repeatable. Default: active."),
    ] = None,
    owner: Annotated[str | None, typer.Option("--owner", help="Only this owner_id's.")] = None,
    kind: Annotated[WorkerKind | None, typer.Option("--kind", help="Only this kind.")] = None,
    provider: Annotated[
        str | None, typer.Option("--provider", help="Only this provider's.")
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="At most this many (with filters).")
    ] = None,
    url: Url = DEFAULT_URL,
    output: Shown = None,
    as_json: AsJson = False,
) -> None:
    """List the active leases, or those matching the filters (wide: with created,
    provider token, correlation id, region and release reason)."""
    shown = _output(output, as_json)
    with _session(url, shown) as client:
        found = client.list(state=state, owner_id=owner, kind=kind, provider=provider, limit=limit)
    if shown is Output.json:
        _print_json(found)
    elif found:
        _stdout().print(_leases_table(found, wide=shown is Output.wide))
    else:
        _stdout().print("No leases.")


@lease_app.command("renew", epilog=EXIT_CODES_HELP)
def lease_renew(
    lease_id: Annotated[str, typer.Argument(help="The lease's id.")],
    ttl: Annotated[
        int | None,
        typer.Option("--ttl", help="New TTL from now, in seconds. Default: the lease's own."),
    ] = None,
    owner: Owner = None,
    url: Url = DEFAULT_URL,
    output: Shown = None,
    as_json: AsJson = False,
) -> None:
    """Extend a lease: it then expires TTL seconds from now."""
    shown = _output(output, as_json)
    with _session(url, shown) as client:
        lease = client.renew(lease_id, ttl_seconds=ttl, owner=owner)
    _show_lease(lease, shown)


@lease_app.command("release", epilog=EXIT_CODES_HELP)
def lease_release(
    lease_id: Annotated[str, typer.Argument(help="The lease's id.")],
    owner: Owner = None,
    url: Url = DEFAULT_URL,
    output: Shown = None,
    as_json: AsJson = False,
) -> None:
    """Release a lease; the scheduler destroys its worker."""
    shown = _output(output, as_json)
    with _session(url, shown) as client, _stderr().status(f"Releasing {lease_id}…"):
        client.release(lease_id, owner=owner)
    if shown is Output.json:
        _print_json({"lease_id": lease_id, "released": True})
    else:
        _stdout().print(f"Released {lease_id}.", highlight=False)


def main() -> None:
    app(prog_name="openalice-scheduler")


# --- helpers ---------------------------------------------------------------------------


def _die(message: str) -> NoReturn:
    for line in message.splitlines():
        typer.echo(f"openalice-scheduler: {line}", err=True)
    raise SystemExit(2)


def _output(output: Output | None, as_json: bool) -> Output:
    if as_json and output not in (None, Output.json):
        raise typer.BadParameter(
            f"--json and -o {output.value} disagree; give one", param_hint="--output"
        )
    return Output.json if as_json else output or Output.table


@contextmanager
def _session(
    url: str, shown: Output, retry: RetryPolicy | None = None
) -> Iterator[SchedulerClient]:
    """A client for the command; its errors become a message and an exit code."""
    if not os.environ.get("INTERNAL_SECRET"):
        _die("INTERNAL_SECRET is not set: export the scheduler's secret")
    _route_client_logs(shown)
    try:
        client = SchedulerClient(url, retry=retry)
    except ValueError as exc:  # a malformed --url
        _die(str(exc))
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
    err = _stderr()
    # No HTTP answer at all is not an HTTP status, whatever exit code it shares.
    status = "" if isinstance(exc, SchedulerUnreachable) else f" (HTTP {exc.status})"
    err.print(f"[bold red]error[/] {exc.code}{status}: {escape(exc.message)}", soft_wrap=True)
    if retry_after is not None:
        err.print(f"retry after {retry_after} s")


def _parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for number, pair in enumerate(pairs, start=1):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            # The entry is not repeated: it may hold a secret value.
            raise typer.BadParameter(f"entry #{number} is not KEY=VALUE", param_hint="--env")
        env[key] = value
    return env


def _show_lease(lease: Lease, shown: Output) -> None:
    if shown is Output.json:
        _print_json(lease)
    else:  # a single lease's table already shows every field: wide is the same
        _stdout().print(_lease_table(lease))


def _print_json(data: BaseModel | list[Any] | dict[str, Any]) -> None:
    def plain(item: Any) -> Any:
        return item.model_dump(mode="json") if isinstance(item, BaseModel) else item

    value = [plain(item) for item in data] if isinstance(data, list) else plain(data)
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


def _lease_table(lease: Lease) -> Any:
    from rich.table import Table

    table = Table(show_header=False, box=None, padding=(0, 2, 0, 0))
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for name, value in lease.model_dump(mode="json").items():
        table.add_row(name, "" if value is None else str(value))
    return table


def _leases_table(leases: list[Lease], wide: bool = False) -> Any:
    from rich.table import Table

    table = Table(box=None, padding=(0, 2, 0, 0), header_style="bold")
    # Never cut an id or a time short: on a narrow terminal the last columns fold instead.
    fixed = [("LEASE ID", 36), ("STATE", 6), ("KIND", 8), ("GPU", 5), ("EXPIRES (UTC)", 19)]
    folding = ["PROVIDER", "OWNER", "ENDPOINT"]
    if wide:
        fixed.insert(4, ("CREATED (UTC)", 19))
        folding[1:1] = ["PROVIDER TOKEN"]
        folding[3:3] = ["CORRELATION ID", "REGION", "REASON"]
    for name, width in fixed:
        table.add_column(name, no_wrap=True, min_width=width)
    for name in folding:
        table.add_column(name, overflow="fold")
    for lease in leases:
        first = [lease.lease_id, lease.state.value, lease.kind.value, lease.gpu.value]
        if not wide:
            table.add_row(
                *first, _utc(lease.expires_at), lease.provider, lease.owner_id or "", lease.endpoint
            )
            continue
        reason = lease.release_reason.value if lease.release_reason else ""
        table.add_row(
            *first,
            _utc(lease.created_at),
            _utc(lease.expires_at),
            lease.provider,
            lease.provider_token,
            lease.owner_id or "",
            lease.correlation_id or "",
            lease.region or "",
            reason,
            lease.endpoint,
        )
    return table


def _utc(timestamp: str) -> str:
    return timestamp[:19].replace("T", " ")


def _providers_table(found: list[ProviderView], wide: bool = False) -> Any:
    from rich.table import Table

    table = Table(box=None, padding=(0, 2, 0, 0), header_style="bold")
    for name in ("PROVIDER", "HEALTHY", "IN USE", "BY GPU"):
        table.add_column(name, no_wrap=True)
    if wide:
        table.add_column("BY KIND", overflow="fold")
    table.add_column("DETAIL", overflow="fold")
    for view in found:
        cap = "∞" if view.max_workers in (None, 0) else str(view.max_workers)
        row = [
            view.name,
            "yes" if view.healthy else "[red]no[/]",
            f"{view.in_use}/{cap}",
            _uses(view.gpu),
        ]
        if wide:
            row.append(
                "; ".join(f"{kind.value} {_uses(uses)}" for kind, uses in view.kinds.items())
            )
        table.add_row(*row, view.detail)
    return table


def _uses(uses: dict[GpuClass, GpuUse]) -> str:
    return ", ".join(
        f"{gpu.value} {use.in_use}/{'∞' if use.capacity is None else use.capacity}"
        for gpu, use in uses.items()
    )


def _stdout() -> Console:
    from rich.console import Console

    # Piped into grep or a file, a table keeps one row per line, however wide.
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=4096 if wide else None)


def _stderr() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


if __name__ == "__main__":
    main()


# Commands of their own modules (they use the helpers above).
from openalice_scheduler.cli_usage import usage  # noqa: E402

app.command(epilog=EXIT_CODES_HELP)(usage)
