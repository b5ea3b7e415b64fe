"""Money settings (README, Prices and caps): each owner's caps, from
MAX_COST_PER_HOUR_PER_OWNER, MAX_SPEND_PER_DAY_PER_OWNER and the per-owner overrides of
OWNER_BUDGETS; and prices per GPU class (LOCAL_DOCKER_PRICE_PER_HOUR,
STATIC_PRICE_PER_HOUR). The store checks the caps (store/spending.py)."""

from __future__ import annotations

import math
import re

from openalice_scheduler.store.records import Budget

_CAP = re.compile(r"(\d+(?:\.\d+)?)/([hd])")


def parse_owner_budgets(value: str | None) -> dict[str, tuple[float | None, float | None]]:
    """`anim=5/h:80/d,live=2/h` as {owner: (per hour, per day)}, None where the owner
    keeps the default. ValueError naming the bad part."""
    found: dict[str, tuple[float | None, float | None]] = {}
    for part in (value or "").split(","):
        if not part.strip():
            continue
        owner, sep, caps = part.strip().partition("=")
        if not sep or not re.fullmatch(r"[\x21-\x7e]{1,128}", owner) or "=" in caps:
            raise ValueError(f"{part.strip()[:64]!r} is not owner=N/h:N/d (e.g. anim=5/h:80/d)")
        if owner in found:
            raise ValueError(f"owner {owner!r} is given twice")
        limits: dict[str, float] = {}
        for cap in caps.split(":"):
            match = _CAP.fullmatch(cap.strip())
            if match is None or match[2] in limits:
                raise ValueError(
                    f"{cap.strip()[:32]!r} in {part.strip()[:64]!r} is not N/h "
                    "(USD per hour of live leases) or N/d (USD per 24 h), once each"
                )
            limits[match[2]] = float(match[1])
        found[owner] = (limits.get("h"), limits.get("d"))
    return found


def parse_prices(value: str) -> dict[str, float]:
    """`0.4` (every GPU class) or `none=0.05,entry=0.4,mid=0.9,high=2.5` (classes not
    named cost 0) as {gpu class: USD per hour}. ValueError naming the bad part."""
    from openalice_scheduler.models import GpuClass

    classes = [g.value for g in GpuClass]
    text = value.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return dict.fromkeys(classes, float(text))
    prices = dict.fromkeys(classes, 0.0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"([a-z]+)\s*=\s*(\d+(?:\.\d+)?)", part)
        if match is None or match[1] not in classes:
            raise ValueError(
                f"{part[:32]!r} is not gpu=price with gpu one of "
                f"{', '.join(classes)} (e.g. entry=0.4), or one price for all"
            )
        prices[match[1]] = float(match[2])
    return prices


class Budgets:
    """Each owner's caps: its OWNER_BUDGETS entry, else the defaults."""

    def __init__(
        self, per_hour: float = 0.0, per_day: float = 0.0, owners: str | None = None
    ) -> None:
        self.default = Budget(per_hour, per_day)
        self.owners: dict[str, Budget] = {}
        for owner, (hour, day) in parse_owner_budgets(owners).items():
            self.owners[owner] = Budget(
                per_hour if hour is None else hour,
                per_day if day is None else day,
                hour_from=self.default.hour_from
                if hour is None
                else f"OWNER_BUDGETS ({owner}={_show(hour)}/h)",
                day_from=self.default.day_from
                if day is None
                else f"OWNER_BUDGETS ({owner}={_show(day)}/d)",
            )

    def of(self, owner: str | None) -> Budget | None:
        """The caps of `owner`; None when it has none (or the lease has no owner)."""
        if owner is None:
            return None
        budget = self.owners.get(owner, self.default)
        return budget if budget.per_hour or budget.per_day else None


def _show(amount: float) -> str:
    return str(int(amount)) if math.isclose(amount, round(amount)) else f"{amount:g}"
