"""What leases cost over time (docs/concepts/money.md#prices-and-caps): the figures usage reports
and an owner's caps in money are weighed against (lifecycle/admission.py).

A lease costs its `price_per_hour` from `granted_at` until `released_at` (or now, while
it lives). Spend over a period counts, of each lease, the part of that time inside the
period: usage over yesterday is what yesterday cost, whatever began before or ends after."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Connection

from openalice_scheduler.store.statements import OWNER_SPENDING

# DAY_US: lifecycle/admission.py still takes it from here.
from openalice_scheduler.times import DAY_US as DAY_US
from openalice_scheduler.times import HOUR_US


def held_us(granted_at: int | None, released_at: int | None, since: int, until: int) -> int:
    """Microseconds of [granted_at, released_at or until] inside [since, until]."""
    if granted_at is None:
        return 0
    end = until if released_at is None else min(released_at, until)
    return max(0, end - max(granted_at, since))


def cost_of(price: float | None, held: int) -> float:
    """USD for `held` microseconds at `price` per hour (unknown: nothing)."""
    return (price or 0.0) * held / HOUR_US


def live_price(conn: Connection, owner: str, lease_id: str = "", *, priced: Any) -> float:
    """USD per hour of what `owner` pays for now, leaving out `lease_id`. `priced`: the
    store's statement for it (LeaseStatements.owner_price)."""
    return float(conn.execute(priced, {"b_id": lease_id, "b_owner": owner}).scalar_one())


def spent_since(conn: Connection, owner: str, since: int, now: int) -> float:
    """USD `owner`'s leases cost from `since` until `now` (live ones: so far)."""
    rows = conn.execute(OWNER_SPENDING, {"b_owner": owner, "b_since": since})
    return sum(cost_of(p, held_us(g, r, since, now)) for p, g, r in rows)
