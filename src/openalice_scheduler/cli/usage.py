"""`openalice-scheduler usage`: GET /v1/usage as a table
(docs/concepts/money.md#usage-and-retention). Registered by the package's `__init__`; its session
and output are common.py's."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Annotated

import typer

from openalice_scheduler.cli.common import (
    AsJson,
    Output,
    Url,
    output_of,
    print_json,
    session,
    stdout,
)
from openalice_scheduler.client import DEFAULT_URL
from openalice_scheduler.models import GroupBy, UsageReport

_AGO = re.compile(r"(\d+)([mhd])")
_UNITS = {"m": "minutes", "h": "hours", "d": "days"}
_WHEN_HELP = (
    "A duration ago (90m, 24h, 7d), today or yesterday (UTC midnights), a date "
    "(2026-11-30) or an RFC 3339 time"
)


def usage(
    since: Annotated[
        str | None, typer.Option("--since", help=f"{_WHEN_HELP}. Default: 24 h before --until.")
    ] = None,
    until: Annotated[
        str | None, typer.Option("--until", help=f"{_WHEN_HELP}. Default: now.")
    ] = None,
    by: Annotated[
        str, typer.Option("--by", help="Group by owner, provider, kind or gpu.")
    ] = "owner",
    url: Url = DEFAULT_URL,
    as_json: AsJson = False,
) -> None:
    """Usage over a period: leases, lease-hours and cost per owner (or provider, kind,
    GPU class); a live lease counts up to now. E.g. yesterday's spend per owner:
    `usage --since yesterday --until today --by owner`."""
    if by not in ("owner", "provider", "kind", "gpu"):
        raise typer.BadParameter("one of owner, provider, kind, gpu", param_hint="--by")
    now = datetime.now(UTC)
    shown = output_of(None, as_json)
    with session(url, shown) as client:
        report = client.usage(
            _group(by), since=_when(since, now, "--since"), until=_when(until, now, "--until")
        )
    if shown is Output.json:
        print_json(report)
    else:
        _print_report(report)


def _when(value: str | None, now: datetime, option: str) -> str | None:
    """What the API takes (an RFC 3339 time or a date) for what a person types."""
    if value is None:
        return None
    text = value.strip().lower()
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if text == "today":
        return midnight.strftime("%Y-%m-%dT%H:%M:%SZ")
    if text == "yesterday":
        return (midnight - timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    if text == "now":
        return now.isoformat()
    ago = _AGO.fullmatch(text)
    if ago:
        return (now - timedelta(**{_UNITS[ago[2]]: int(ago[1])})).isoformat()
    if text[:1].isdigit():
        return value.strip()  # a date or a time: the API checks it, naming the parameter
    raise typer.BadParameter(
        f"{value!r}: expected {_WHEN_HELP[0].lower()}{_WHEN_HELP[1:]}", param_hint=option
    )


def _group(by: str) -> GroupBy:
    groups: dict[str, GroupBy] = {
        "owner": "owner",
        "provider": "provider",
        "kind": "kind",
        "gpu": "gpu",
    }
    return groups[by]


def _print_report(report: UsageReport) -> None:
    from rich.table import Table

    table = Table(title=f"Usage {report.since} → {report.until}", title_justify="left")
    table.add_column(report.group_by)
    for name in ("leases", "live", "lease-hours", "cost $"):
        table.add_column(name, justify="right")
    for group in report.groups:
        table.add_row(
            "(none)" if group.key is None else group.key,
            str(group.leases),
            str(group.live),
            _amount(group.lease_hours),
            _amount(group.cost),
        )
    total = report.total
    table.add_section()
    table.add_row(
        "total", str(total.leases), str(total.live), _amount(total.lease_hours), _amount(total.cost)
    )
    out = stdout()
    out.print(table)
    if not report.complete and report.note:
        out.print(f"Incomplete: {report.note}", highlight=False)


def _amount(value: float) -> str:
    """Two decimals, four below 1 (as the dashboard shows money): a few minutes of a
    cheap worker still shows what it cost."""
    return f"{value:.4f}" if value < 1 else f"{value:.2f}"
