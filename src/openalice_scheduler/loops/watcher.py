"""The watcher: follows each provider whose backend streams its workers' lives
(WatchingProvider: the Docker engine's events, the Kubernetes pod watch, the static
endpoints' probes) and hands each death it hears to the service (lifecycle/losing.py),
which ends the lease within moments of the death. Watch, then list: each time a stream
(re)opens, the reconciler is woken for that provider, as the deaths missed meanwhile are
its listing's to find. Every replica watches; the service's guarded move ends a lease once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from openalice_scheduler.errors import SchedulerError
from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.providers import Resync, WatchingProvider, WorkerEnded

# The loops' lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.loops")
# A provider's stream that failed outright (a defect: streams reconnect by themselves)
# is followed again after this long.
AGAIN_AFTER_S = 5.0


class Watcher:
    name = "watcher"

    def __init__(
        self, service: LeaseService, on_resync: Callable[[str], None] = lambda _name: None
    ) -> None:
        self.service = service
        self.providers = [p for p in service.providers if isinstance(p, WatchingProvider)]
        # Called with the provider's name on every Resync: the reconciler's wake for it.
        self.on_resync = on_resync
        self.heard = 0  # deaths heard that ended a lease (tests, the bench)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._follow(provider), name=f"watch-{provider.name}")
            for provider in self.providers
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _follow(self, provider: WatchingProvider) -> None:
        while True:
            try:
                async for heard in provider.watch():
                    if isinstance(heard, Resync):
                        log.debug("watch of %s (re)opened: %s", provider.name, heard.where)
                        self.on_resync(provider.name)
                        continue
                    await self._hand_over(provider, heard)
                return  # a stream that ends by itself has nothing to tell (static, unprobed)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("watch of %s failed; followed again", provider.name)
            await asyncio.sleep(AGAIN_AFTER_S)

    async def _hand_over(self, provider: WatchingProvider, heard: WorkerEnded) -> None:
        try:
            if await self.service.worker_ended(provider, heard):
                self.heard += 1
        except SchedulerError as exc:  # the store away: the reconciler's listing finds it
            log.warning(
                "watch of %s: a death not recorded yet (%s); the reconciler will",
                provider.name,
                exc.message,
            )
