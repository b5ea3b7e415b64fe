"""The purge of ended leases past LEASE_RETENTION_DAYS (README, Usage and retention), a
loop of its own: without it the leases table grows with every lease ever made."""

from __future__ import annotations

import logging

from openalice_scheduler.loops import LoopService
from openalice_scheduler.service import LeaseService
from openalice_scheduler.store.spending import DAY_US
from openalice_scheduler.store.usage import purge_ended

log = logging.getLogger(__name__)
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
        before = self.service.now_us() - self.days * DAY_US
        purged = await purge_ended(self.service.store.backend, before=before)
        if purged:
            log.info(
                "purged %d ended leases older than %d days (LEASE_RETENTION_DAYS)",
                purged,
                self.days,
            )
        return purged
