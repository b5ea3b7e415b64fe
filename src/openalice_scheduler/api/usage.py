"""GET /v1/usage: leases, lease-hours and cost per owner, provider, kind or GPU class
over a period (docs/concepts/money.md#usage-and-retention). The counting is the service's
(store/usage.py)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Security
from pydantic import StringConstraints, WithJsonSchema

from openalice_scheduler.api.deps import SECRET_HEADER, ServiceDep
from openalice_scheduler.api.openapi import errors
from openalice_scheduler.errors import InvalidRequest
from openalice_scheduler.models import GroupBy, UsageGroup, UsageReport
from openalice_scheduler.times import DAY_US, format_us, to_us

router = APIRouter(prefix="/v1", tags=["usage"], dependencies=[Security(SECRET_HEADER)])

_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# What `_instant` always reads, as the document states it (the parameters' `pattern`, for
# clients and fuzzers built from it): an RFC 3339 date-time with its UTC offset, or a
# full date, every field in range. `[0-9]`, not `\d`, which in Python's expressions (and
# a fuzzer's) takes the digits of every script. What a pattern cannot say (a day that
# exists, the UTC range, since before until) the description does. Python's
# fromisoformat reads a few more ISO 8601 forms; they stay accepted, undocumented.
_TIME = (
    "[Tt]([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]([.][0-9]+)?"
    "([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
)
INSTANT_PATTERN = (
    "^(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
    f"-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])({_TIME})?$"
)
_MAX_LENGTH = 64
Instant = Annotated[
    str,
    StringConstraints(max_length=_MAX_LENGTH),
    WithJsonSchema({"type": "string", "maxLength": _MAX_LENGTH, "pattern": INSTANT_PATTERN}),
]
# The earliest time a report can show (format_us): 0001-01-01T00:00:00Z.
_FIRST_US = to_us(datetime(1, 1, 1, tzinfo=UTC))
_TIME_HELP = (
    "RFC 3339 time with its UTC offset (`2026-11-30T12:00:00Z`, `…+05:30`) or a date "
    "(`2026-11-30`: its UTC midnight), as `pattern` says; the day must exist in its "
    "month, the time fall within 0001-01-01 and 9999-12-31 in UTC, and `since` come "
    "before `until`"
)


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
        Instant | None, Query(description=f"{_TIME_HELP}. Default: 24 h before `until`.")
    ] = None,
    until: Annotated[
        Instant | None,
        Query(
            description=f"{_TIME_HELP}. Default: now (without `since`: at least "
            "0001-01-02T00:00:00Z, as since is then 24 h before)."
        ),
    ] = None,
    group_by: GroupBy = "owner",
) -> UsageReport:
    now = service.now_us()
    end = _instant(until, "until") if until is not None else now
    start = _instant(since, "since") if since is not None else end - DAY_US
    if start < _FIRST_US:  # only the default can be: a given since is checked above
        raise InvalidRequest(
            "until: the default since, 24 h before it, is before 0001-01-01; give since",
            field="until",
        )
    if start >= end:
        raise InvalidRequest(f"since: must be before until ({format_us(end)})", field="since")
    found = await service.usage(group_by, since=start, until=end)
    retention = request.app.state.settings.lease_retention_days
    kept_from = now - retention * DAY_US
    complete = retention == 0 or start >= kept_from
    return UsageReport(
        since=format_us(start),
        until=format_us(end),
        group_by=group_by,
        groups=[UsageGroup(key=key, **t.figures().model_dump()) for key, t in found.by_cost()],
        total=found.total.figures(),
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
