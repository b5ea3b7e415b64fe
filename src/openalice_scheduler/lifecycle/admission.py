"""Who may take capacity, and on what terms: the rules a reservation must meet, written
once here. Its transaction (the store runs it, under the owner's and the provider's
locks) checks them: a second lease for the same request, the owner's quota of live
leases, the provider's cap and exclusive devices (or a fleet's placement), the owner's
caps in money. The terms of one reservation are `Terms`; an owner's caps `Budgets`."""

from __future__ import annotations

import math

from openalice_scheduler.errors import Forbidden
from openalice_scheduler.prices import parse_owner_budgets
from openalice_scheduler.providers import PlacingProvider, Provider, WorkerSpec
from openalice_scheduler.store import LeaseRecord
from openalice_scheduler.store.records import Budget, Terms


def reservation_terms(
    provider: Provider,
    spec: WorkerSpec,
    *,
    now: int,
    owner_quota: int,
    price: float | None = None,
    budget: Budget | None = None,
) -> Terms:
    """What reserving `spec` on `provider` at `price` (its `price(spec)`) must respect.
    A placing provider's placer counts its caps itself, per place, and gives the price
    of the place it picks."""
    if isinstance(provider, PlacingProvider):
        return Terms(
            now=now,
            owner_quota=owner_quota,
            place=provider.placer(spec),
            price_per_hour=price,
            budget=budget,
        )
    return Terms(
        now=now,
        max_live=provider.max_workers,
        resources=provider.exclusive_resources(spec),
        resource_label=provider.resource_label,
        owner_quota=owner_quota,
        price_per_hour=price,
        budget=budget,
    )


def check_owner(record: LeaseRecord, owner: str | None) -> None:
    """A lease with an owner is renewed and released only with its X-Lease-Owner."""
    if record.owner_id is not None and owner != record.owner_id:
        if owner is None:
            raise Forbidden(f"lease {record.lease_id} has an owner; send X-Lease-Owner")
        raise Forbidden(f"X-Lease-Owner does not match the owner of lease {record.lease_id}")


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
