"""Waiting for new pods to run: one loop for all of a provider's starting pods, so that
50 pods starting at once cost one list call per round, not 50 reads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from openalice_scheduler.providers.runpod.client import ErrorKind, Pod, RunPodClient, RunPodError

log = logging.getLogger(__name__)

_FIRST_POLL_S = 0.25


@dataclass(slots=True)
class _Starting:
    """A pod being waited for until it runs."""

    waiter: asyncio.Future[Pod | None]
    since: float  # monotonic time of the create
    due: float  # monotonic time of its next look


class StartWatch:
    """The pods being waited for, by id, and the one loop that looks at them. A lasting
    RunPod failure (not a passing one: a timeout, 429, unreachable) fails every waiter
    with `failure(error)`."""

    def __init__(
        self,
        client: RunPodClient,
        poll_interval: float,
        failure: Callable[[RunPodError], Exception],
    ) -> None:
        self.client = client
        self.poll_interval = poll_interval
        self.failure = failure
        self.pending: dict[str, _Starting] = {}
        self._watcher: asyncio.Future[None] | None = None
        self._wake = asyncio.Event()

    async def settled(self, pod_id: str) -> Pod | None:
        """The pod once it runs or died; None when it is gone."""
        waiter: asyncio.Future[Pod | None] = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        self.pending[pod_id] = _Starting(waiter, now, now + min(_FIRST_POLL_S, self.poll_interval))
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch())
        self._wake.set()
        try:
            return await waiter
        finally:
            self.pending.pop(pod_id, None)

    @property
    def watching(self) -> bool:
        """Whether the loop runs: only while some pod is being waited for."""
        return self._watcher is not None and not self._watcher.done()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()  # nothing, once it has ended

    async def _watch(self) -> None:
        """One loop for all starting pods. Each pod has its own next look: soon after its
        create (a fast start is not made to wait a whole interval), then after half its
        age, up to RUNPOD_POLL_INTERVAL_SECONDS. The loop looks when the first pod is due
        and then at every pod at once: one read by id for a single pod, one list for
        several. A new pod can only bring the next look closer, never postpone it."""
        while self.pending:
            self._wake.clear()
            delay = min(w.due for w in self.pending.values()) - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), delay)
                    continue  # a new pod: it may be due sooner
                except TimeoutError:
                    if not self.pending:
                        break  # their callers gave up meanwhile: nothing to look at
            looked_at = time.monotonic()
            try:
                await self._look()
            except RunPodError as exc:
                if not (
                    exc.uncertain or exc.kind in (ErrorKind.rate_limited, ErrorKind.unreachable)
                ):
                    failure = self.failure(exc)
                    for waiting in list(self.pending.values()):
                        if not waiting.waiter.done():
                            waiting.waiter.set_exception(failure)
                    self.pending.clear()
                # else: a passing failure while waiting: keep waiting
            except Exception:  # noqa: BLE001 - the loop must not die with waiters left
                log.exception("RunPod start watcher: unexpected failure; retrying")
            finally:
                for waiting in self.pending.values():
                    age = looked_at - waiting.since
                    waiting.due = looked_at + min(self.poll_interval, max(_FIRST_POLL_S, age / 2))

    async def _look(self) -> None:
        waiting = dict(self.pending)
        if len(waiting) == 1:
            [pod_id] = waiting
            seen: dict[str, Pod | None] = {pod_id: await self.client.get_pod(pod_id)}
        else:
            listed = {pod.id: pod for pod in await self.client.list_pods()}
            seen = {pod_id: listed.get(pod_id) for pod_id in waiting}
        for pod_id, pod in seen.items():
            if pod is None and len(waiting) > 1:
                pod = await self.client.get_pod(pod_id)  # not listed: make sure it is gone
            if pod is None or pod.running or pod.dead:
                # Settled: out of the loop's sight at once, not when its caller next runs
                # (the loop would look at it again meanwhile, or list nothing).
                self.pending.pop(pod_id, None)
                waiter = waiting[pod_id].waiter
                if not waiter.done():
                    waiter.set_result(pod)
