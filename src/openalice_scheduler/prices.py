"""Money settings read (docs/concepts/money.md#prices-and-caps): the per-owner caps of
OWNER_BUDGETS, and prices per GPU class (LOCAL_DOCKER_PRICE_PER_HOUR, STATIC_PRICE_PER_HOUR). What
the caps admit is the core's (lifecycle/admission.py)."""

from __future__ import annotations

import re

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
