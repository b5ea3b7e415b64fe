"""What the store does not keep for ever, each a loop of its own: ended leases past
LEASE_RETENTION_DAYS (docs/concepts/money.md#usage-and-retention), without which the leases table
grows with every lease ever made; and guards silent past GUARD_FORGET_SECONDS
(docs/concepts/guard.md#the-guard), without which each guard ever seen stays listed, a series on
/metrics and an alert."""

from __future__ import annotations

import logging

from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.lifecycle.guards import GuardDesk
from openalice_scheduler.loops.base import LoopService

# The retention's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.retention")
PURGE_INTERVAL_S = 3600.0


class Purger(LoopService):
    """Deletes released and failed leases whose release is older than `days`. Every
    replica runs one: the deletes are idempotent, and batched (store/usage.py)."""

    name = "purger"

    def __init__(
        self, service: LeaseService, days: int, interval: float = PURGE_INTERVAL_S
    ) -> None:
        super().__init__(interval)
        self.service = service
        self.days = days

    async def run_once(self) -> int:
        purged = await self.service.purge_ended(days=self.days)
        if purged:
            log.info(
                "purged %d ended leases older than %d days (LEASE_RETENTION_DAYS)",
                purged,
                self.days,
            )
        return purged


class GuardForgetter(LoopService):
    """Forgets the guards silent for GUARD_FORGET_SECONDS, looking a few times within
    that time (at least once a minute), whether or not any guard polls meanwhile. Every
    replica runs one: deleting the same rows twice is harmless. Their metric series go
    with the rows: /metrics sets the guards' series anew from the store at each scrape."""

    name = "guard-forgetter"

    def __init__(self, service: LeaseService, desk: GuardDesk, forget_seconds: float) -> None:
        super().__init__(min(60.0, forget_seconds / 4))
        self.service = service
        self.desk = desk
        self.forget_seconds = forget_seconds

    async def run_once(self) -> int:
        forgotten = await self.desk.forget(self.service.now_us())
        if forgotten:
            log.info(
                "forgot %d guard(s) silent for more than %g s (GUARD_FORGET_SECONDS)",
                forgotten,
                self.forget_seconds,
            )
        return forgotten
