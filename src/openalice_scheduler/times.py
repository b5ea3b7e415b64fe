"""Times as the scheduler keeps them: integer microseconds since the epoch (UTC), shown
in RFC 3339. Below every layer that keeps, compares or shows a time (the store, the
core, the routes, the loops), so none of them takes these from another."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

HOUR_US = 3_600_000_000
DAY_US = 24 * HOUR_US

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_NAIVE = datetime(1970, 1, 1)


def to_us(moment: datetime) -> int:
    """Integer microseconds since the epoch (UTC): how the store keeps every time."""
    delta = moment.astimezone(UTC) - _EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def format_us(us: int) -> str:
    """RFC 3339 in UTC with microseconds: `2026-11-29T17:34:49.948395Z`."""
    return (_EPOCH_NAIVE + timedelta(microseconds=us)).isoformat(timespec="microseconds") + "Z"
