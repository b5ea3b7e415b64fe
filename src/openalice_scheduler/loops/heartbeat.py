"""The heartbeat: tells the other replicas this one is alive."""

from __future__ import annotations

from openalice_scheduler.errors import StoreUnavailable
from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.loops.base import LoopService


class Heartbeat(LoopService):
    """Tells the other replicas this one is alive, so that they resolve its provisions
    only once it stops."""

    name = "heartbeat"

    def __init__(self, service: LeaseService, interval: float) -> None:
        super().__init__(interval)
        self.service = service
        self._failed_at: float | None = None  # monotonic time of the last failed beat

    async def run_once(self) -> None:
        try:
            await self.service.store.replicas.heartbeat(now=self.service.now_us())
        except StoreUnavailable:
            self._failed_at = self.service.clock.monotonic()
            raise

    def steady_for(self, seconds: float) -> bool:
        """No heartbeat of this replica failed in the last `seconds`: had another
        replica stopped beating meanwhile, it was not for a store outage."""
        if self._failed_at is None:
            return True
        return self.service.clock.monotonic() - self._failed_at >= seconds
