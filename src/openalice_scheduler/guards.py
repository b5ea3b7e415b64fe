"""What the scheduler tells its guards, and shows of them (README, The guard).

A guard (guard/, `openalice-scheduler guard`) polls `GET /v1/guard` every
GUARD_POLL_SECONDS. The answer is what it must know to act alone once no scheduler
answers: the store's id and instance (whose workers it watches), the longest TTL a
lease can have, and until when each live worker may run. Each poll is recorded in the
store, so every replica shows each guard's last contact (`GET /v1/providers`, metrics)."""

from __future__ import annotations

from typing import Any

from openalice_scheduler.models import MAX_TTL_SECONDS, LeaseState
from openalice_scheduler.store import LeaseStore, format_us
from openalice_scheduler.store.guards import GuardContact, GuardStore


class GuardDesk:
    def __init__(self, store: LeaseStore, *, instance: str) -> None:
        self.store = store
        self.guards = GuardStore(store.backend)
        self.instance = instance

    async def poll(self, guard_id: str, providers: tuple[str, ...], now: int) -> dict[str, Any]:
        """The guard's contact recorded, and the deadline of every live worker of the
        providers it watches: its lease's expiry, or for a lease already ending
        (`releasing`) the moment it ended, since its worker should be gone already."""
        await self.guards.contact(guard_id, providers, now=now)
        workers = []
        for row in await self.guards.live(providers):
            until = row.expires_at
            if row.state == LeaseState.releasing.value and row.released_at is not None:
                until = min(until, row.released_at)
            workers.append(
                {
                    "lease_id": row.lease_id,
                    "provider": row.provider,
                    "state": row.state,
                    "until": format_us(until),
                }
            )
        return {
            "store_id": self.store.store_id,
            "instance": self.instance,
            "max_ttl_seconds": MAX_TTL_SECONDS,
            "now": format_us(now),
            "workers": workers,
        }

    async def contacts(self) -> list[GuardContact]:
        """Every guard that polled in the last day, with its last contact."""
        return await self.guards.contacts()

    async def by_provider(self) -> dict[str, list[GuardContact]]:
        """Each provider's guards (a guard watching two providers is under both)."""
        found: dict[str, list[GuardContact]] = {}
        for contact in await self.contacts():
            for provider in contact.providers:
                found.setdefault(provider, []).append(contact)
        return found
