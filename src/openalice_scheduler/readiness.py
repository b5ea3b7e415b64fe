"""Whether this process should get traffic (`GET /readyz`): its store answers, start-up
reconciliation is done, and it is not draining. Liveness (`/health`) is another
question: a store outage must make a balancer look elsewhere, not kill the process."""

from __future__ import annotations

import asyncio

from openalice_scheduler.errors import StoreUnavailable
from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.loops import Reconciler

# A balancer probes every few seconds: a store slower than this counts as unavailable.
STORE_TIMEOUT_S = 2.0
SHUTTING_DOWN = "shutting down"
STORE_UNAVAILABLE = "store unavailable"
NOT_RECONCILED = "start-up reconciliation not finished"


class ReadinessCheck:
    """What `/readyz` asks, set up by the lifespan once the service serves."""

    def __init__(self, service: LeaseService, reconciler: Reconciler, *, reconciled: bool) -> None:
        self.service = service
        self.reconciler = reconciler
        # Whether the reconciliation before serving finished; else the reconciler's
        # loop retries, and its first finished pass counts.
        self.reconciled = reconciled

    @property
    def draining(self) -> bool:
        return self.service.line.closed

    async def reasons(self) -> list[str]:
        """Why not ready (fixed phrases, never a cause's text: no DSN, no secret); []
        when ready. While draining, that alone, at once."""
        if self.draining:
            return [SHUTTING_DOWN]
        reasons = []
        try:
            await asyncio.wait_for(self.service.store.ping(), STORE_TIMEOUT_S)
        except (StoreUnavailable, TimeoutError):
            reasons.append(STORE_UNAVAILABLE)
        if not (self.reconciled or self.reconciler.passes):
            reasons.append(NOT_RECONCILED)
        return reasons
