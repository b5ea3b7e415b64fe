"""The admission loop's runner (docs/concepts/priorities.md#the-admission-loop): on one
replica at a time, the leader, it hands the core a pass over the whole line
(LeaseService.admit) whenever the line may move (a caller joined, a room was freed, on
any replica) and at least once a second (waits run out, callers age).

The leader holds the store's `admission` lock, kept for LOCK_S and renewed by every
pass; a replica whose heartbeat is older than the line's timeout (4 s) loses it at
once, so another replica takes over within 5 s of the leader's death."""

from __future__ import annotations

import time
from collections.abc import Callable

from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.loops.base import LoopService

ADMISSION_LOCK = "admission"
LOCK_S = 5.0
TICK_S = 1.0


class AdmissionLoop(LoopService):
    name = "admission"

    def __init__(self, service: LeaseService, line_timeout: float) -> None:
        super().__init__(TICK_S)
        self.service = service
        self.line_timeout = line_timeout
        self.leader = False
        # Called when this replica becomes the leader (the warm pools are sized there).
        self.on_lead: Callable[[], None] = lambda: None
        self._tried_at = -TICK_S
        service.on_line(self.wake)

    async def run_once(self) -> int:
        service = self.service
        now = service.now_us()
        if not self.leader and service.clock.monotonic() - self._tried_at < TICK_S:
            return 0  # another replica leads: asked again once a second, not per wake
        self._tried_at = service.clock.monotonic()
        was = self.leader
        self.leader = await service.store.replicas.try_lock(
            ADMISSION_LOCK,
            ttl_us=int(LOCK_S * 1e6),
            now=now,
            holder_gone_before=now - int(self.line_timeout * 1e6),
        )
        if self.leader and not was:
            self.on_lead()
        service.metrics.admission_leader.set(1 if self.leader else 0)
        if not self.leader:
            return 0
        started = time.perf_counter()
        decided = await service.admit()
        service.metrics.admission_pass_seconds.observe(time.perf_counter() - started)
        service.metrics.admission_decisions.inc(decided)
        return decided

    async def release(self) -> None:
        """Give the lock up (drain, stop): another replica leads at once."""
        if self.leader:
            await self.service.store.replicas.unlock(ADMISSION_LOCK)
            self.leader = False
            self.service.metrics.admission_leader.set(0)
