"""What the scheduler tells its guards, and shows of them (docs/concepts/guard.md#the-guard).

A guard (guard/, `openalice-scheduler guard`) polls `GET /v1/guard` every
GUARD_POLL_SECONDS. The answer is what it must know to act alone once no scheduler
answers: the store's id and instance (whose workers it watches), the longest TTL a
lease can have, and until when each live worker may run. Each poll is recorded in the
store, so every replica shows each guard's last contact (`GET /v1/providers`, metrics).

What is recorded is bounded, as the poll is open to anyone with the secret and each
guard recorded is a series on the ungated /metrics and a SchedulerGuardSilent alert once
it falls silent: only guards of this scheduler's providers, at most MAX_GUARDS of them,
and a guard silent for GUARD_FORGET_SECONDS is forgotten (`forget`, on a timer:
retention.GuardForgetter)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from openalice_scheduler.errors import InvalidRequest, TooManyGuards
from openalice_scheduler.models import MAX_TTL_SECONDS, LeaseState
from openalice_scheduler.store import LeaseStore
from openalice_scheduler.store.guards import GuardContact, GuardsFull, GuardStore
from openalice_scheduler.times import format_us


class GuardDesk:
    """`providers`: the names of this scheduler's providers (PROVIDERS); `most`: the
    guards it records at most (MAX_GUARDS); `forget_seconds`: how long a guard may be
    silent before it is forgotten (GUARD_FORGET_SECONDS)."""

    def __init__(
        self,
        store: LeaseStore,
        *,
        instance: str,
        providers: Sequence[str],
        most: int,
        forget_seconds: float,
    ) -> None:
        self.store = store
        self.guards = GuardStore(store.backend, store.states.holds_capacity)
        self.instance = instance
        self.providers = tuple(providers)
        self.most = most
        self.forget_us = int(forget_seconds * 1e6)

    async def poll(self, guard_id: str, providers: tuple[str, ...], now: int) -> dict[str, Any]:
        """The guard's contact recorded, and the deadline of every live worker of the
        providers it watches: its lease's expiry, or for a lease already ending
        (`releasing`) the moment it ended, since its worker should be gone already.
        InvalidRequest when it names a provider this scheduler does not run;
        TooManyGuards when it is new and there is no room for it."""
        providers = self._watched(providers)
        try:
            await self.guards.contact(
                guard_id, providers, now=now, most=self.most, forget_before=now - self.forget_us
            )
        except GuardsFull as full:
            # Room comes back, at the earliest, when the longest silent guard is forgotten.
            wait = max(1, math.ceil((full.oldest_contact_at + self.forget_us - now) / 1e6))
            raise TooManyGuards(
                f"this scheduler records at most {self.most} guards (MAX_GUARDS) and "
                f"knows {full.known}: a new guard is recorded once one of them has been "
                f"silent for GUARD_FORGET_SECONDS ({self.forget_us / 1e6:g} s) and is "
                "forgotten; the known guards poll on",
                headers={"Retry-After": str(wait)},
                limit=self.most,
            ) from None
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

    def _watched(self, providers: tuple[str, ...]) -> tuple[str, ...]:
        """The providers a guard names, each once, in its order; each one must be this
        scheduler's (a guard of another's would be recorded and alerted on for ever)."""
        watched = tuple(dict.fromkeys(providers))
        unknown = [name for name in watched if name not in self.providers]
        if unknown:
            names = ", ".join(repr(name) for name in unknown)
            what = "is not a provider" if len(unknown) == 1 else "are not providers"
            raise InvalidRequest(
                f"providers: {names} {what} of this scheduler; its providers "
                f"(PROVIDERS): {', '.join(self.providers)}",
                field="providers",
            )
        return watched

    async def forget(self, now: int) -> int:
        """Forget the guards silent for GUARD_FORGET_SECONDS; how many."""
        return await self.guards.forget(before=now - self.forget_us)

    async def contacts(self) -> list[GuardContact]:
        """Every guard recorded, with its last contact."""
        return await self.guards.contacts()

    async def by_provider(self) -> dict[str, list[GuardContact]]:
        """Each provider's guards (a guard watching two providers is under both)."""
        found: dict[str, list[GuardContact]] = {}
        for contact in await self.contacts():
            for provider in contact.providers:
                found.setdefault(provider, []).append(contact)
        return found
