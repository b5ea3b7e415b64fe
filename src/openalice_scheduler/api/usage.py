"""GET /v1/usage: leases, lease-hours and cost per owner, provider, kind or GPU class
over a period (README, Usage and retention). The counting is store/usage.py's."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Security

from openalice_scheduler.api.deps import SECRET_HEADER, ServiceDep
from openalice_scheduler.api.openapi import errors
from openalice_scheduler.errors import InvalidRequest
from openalice_scheduler.models import GroupBy, UsageFigures, UsageGroup, UsageReport
from openalice_scheduler.store import usage as counting
from openalice_scheduler.store.records import format_us, to_us
from openalice_scheduler.store.spending import DAY_US

router = APIRouter(prefix="/v1", tags=["usage"], dependencies=[Security(SECRET_HEADER)])

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
_TIME_HELP = "RFC 3339 time (`2026-11-30T12:00:00Z`) or a date (`2026-11-30`: its UTC midnight)"


@router.get(
    "/usage",
    response_model=UsageReport,
    summary="Usage: leases, lease-hours and cost per group over a period",
    responses=errors(422, 503),
)
async def usage(
    request: Request,
    service: ServiceDep,
    since: Annotated[
        str | None,
        Query(max_length=64, description=(f"{_TIME_HELP}; default: 24 h before `until`.")),
    ] = None,
    until: Annotated[
        str | None, Query(max_length=64, description=(f"{_TIME_HELP}; default: now."))
    ] = None,
    group_by: GroupBy = "owner",
) -> UsageReport:
    now = service.now_us()
    end = _instant(until, "until") if until is not None else now
    start = _instant(since, "since") if since is not None else end - DAY_US
    if start >= end:
        raise InvalidRequest(f"since: must be before until ({format_us(end)})", field="since")
    found = await counting.usage(service.store.backend, group_by, since=start, until=end, now=now)
    retention = request.app.state.settings.lease_retention_days
    kept_from = now - retention * DAY_US
    complete = retention == 0 or start >= kept_from
    return UsageReport(
        since=format_us(start),
        until=format_us(end),
        group_by=group_by,
        groups=[UsageGroup(key=key, **_figures(t).model_dump()) for key, t in found.by_cost()],
        total=_figures(found.total),
        retention_days=retention,
        complete=complete,
        note=None
        if complete
        else (
            f"leases ended before {format_us(kept_from)} ({retention} days ago, "
            "LEASE_RETENTION_DAYS) are purged: they are missing from these figures"
        ),
    )


def _instant(value: str, name: str) -> int:
    """Microseconds of an RFC 3339 time (with its offset) or a date's UTC midnight."""
    text = value.strip()
    try:
        if _DATE.fullmatch(text):
            return to_us(datetime.strptime(text, "%Y-%m-%d").replace(tzinfo=UTC))
        moment = datetime.fromisoformat(text.replace("z", "Z"))
    except ValueError:
        raise InvalidRequest(
            f"{name}: not an RFC 3339 time or a date (YYYY-MM-DD)", field=name
        ) from None
    if moment.tzinfo is None:
        raise InvalidRequest(
            f"{name}: an RFC 3339 time needs a date, a time and a UTC offset (Z or +hh:mm)",
            field=name,
        )
    try:
        return to_us(moment)
    except OverflowError:  # 9999-12-31T23:59:59-01:00 is after year 9999 in UTC
        raise InvalidRequest(f"{name}: out of range", field=name) from None


def _figures(t: counting.Tally) -> UsageFigures:
    return UsageFigures(
        leases=t.leases, live=t.live, lease_hours=round(t.lease_hours, 6), cost=round(t.cost, 6)
    )
