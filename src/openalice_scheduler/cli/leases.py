"""`openalice-scheduler lease …` (acquire, get, ls, renew, release) and `providers`."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from openalice_scheduler.cli.common import (
    EXIT_CODES_HELP,
    AsJson,
    Output,
    Owner,
    Shown,
    Url,
    output_of,
    print_json,
    session,
    stderr,
    stdout,
)
from openalice_scheduler.client import DEFAULT_URL, RetryPolicy
from openalice_scheduler.models import (
    GpuClass,
    GpuUse,
    Lease,
    LeaseState,
    ProviderView,
    WorkerKind,
)

lease_app = typer.Typer(
    help="Acquire, inspect, renew and release leases on a running scheduler.",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
)


def providers(url: Url = DEFAULT_URL, output: Shown = None, as_json: AsJson = False) -> None:
    """Providers: health, capacity and use per GPU class (wide: per worker kind too)."""
    shown = output_of(output, as_json)
    with session(url, shown) as client:
        found = client.providers()
    if shown is Output.json:
        print_json(found)
    else:
        stdout().print(_providers_table(found, wide=shown is Output.wide))


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
    priority_class: Annotated[
        str | None,
        typer.Option(
            "--priority-class",
            help="A class of the scheduler's PRIORITY_CLASSES; default: the owner's, else "
            "`default`.",
        ),
    ] = None,
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
    shown = output_of(output, as_json)
    worker_env = _parse_env(env or [])
    retry = RetryPolicy(timeout=retry_timeout) if retry_timeout > 0 else None
    with (
        session(url, shown, retry) as client,
        stderr().status(f"Acquiring a worker (kind={kind.value}, gpu={gpu.value})…"),
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
            priority_class=priority_class,
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
    shown = output_of(output, as_json)
    with session(url, shown) as client:
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
    shown = output_of(output, as_json)
    with session(url, shown) as client:
        found = client.list(state=state, owner_id=owner, kind=kind, provider=provider, limit=limit)
    if shown is Output.json:
        print_json(found)
    elif found:
        stdout().print(_leases_table(found, wide=shown is Output.wide))
    else:
        stdout().print("No leases.")


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
    shown = output_of(output, as_json)
    with session(url, shown) as client:
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
    shown = output_of(output, as_json)
    with session(url, shown) as client, stderr().status(f"Releasing {lease_id}…"):
        client.release(lease_id, owner=owner)
    if shown is Output.json:
        print_json({"lease_id": lease_id, "released": True})
    else:
        stdout().print(f"Released {lease_id}.", highlight=False)


# --- output -----------------------------------------------------------------------------


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
        print_json(lease)
    else:  # a single lease's table already shows every field: wide is the same
        stdout().print(_lease_table(lease))


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
        folding[3:3] = ["CLASS", "PREEMPT AT (UTC)", "CORRELATION ID", "REGION", "REASON"]
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
            lease.priority_class,
            _utc(lease.preempt_at) if lease.preempt_at else "",
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
