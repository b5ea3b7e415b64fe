"""The wait for a new pod to run (docs/backends/kubernetes.md#the-wait-for-a-pod), as real
clusters make it: the pod's changes heard from a watch, and while it is unschedulable the
cluster autoscaler's word on it, read from the pod's events.

- Unschedulable, with the autoscaler's `TriggeredScaleUp` event: a node is on its way
  (often 2 to 6 minutes), so the pod is waited for up to K8S_SCALE_UP_TIMEOUT_SECONDS
  from its creation instead of K8S_SCHEDULE_TIMEOUT_SECONDS.
- Unschedulable, with `NotTriggerScaleUp` ("pod didn't trigger scale-up: ..."): no node
  group could take it; refused at once, in the autoscaler's words.
- An image pull that fails (`ErrImagePull`, then `ImagePullBackOff`) is tried again by
  the kubelet and often succeeds: given up K8S_IMAGE_PULL_TIMEOUT_SECONDS after the first
  failure seen; `InvalidImageName` and `ErrImageNeverPull` at once.

The events come from the cluster autoscaler
(https://github.com/kubernetes/autoscaler/blob/master/cluster-autoscaler/FAQ.md, "What
events are emitted by CA?"): source `cluster-autoscaler`, reasons `TriggeredScaleUp`
("pod triggered scale-up: [{group 1->2 (max: 5)}]") and `NotTriggerScaleUp`.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from lightkube.resources.core_v1 import Event, Pod

from openalice_scheduler.errors import ProviderError, ProviderOutOfCapacity
from openalice_scheduler.providers.kubernetes import objects

log = logging.getLogger(__name__)

AUTOSCALER = "cluster-autoscaler"
TRIGGERED = "TriggeredScaleUp"
NOT_TRIGGERED = "NotTriggerScaleUp"
# How often an unschedulable pod's events are read again for the autoscaler's word (its
# own loop scans every 10 s by default); once more when K8S_SCHEDULE_TIMEOUT_SECONDS ends.
EVENTS_EVERY_S = 5.0
_EPOCH = datetime.datetime.min.replace(tzinfo=datetime.UTC)


@dataclass(frozen=True, slots=True)
class Limits:
    """How long each wait may last, in seconds (the K8S_*_TIMEOUT_SECONDS settings)."""

    schedule: float
    scale_up: float
    image_pull: float


@dataclass(frozen=True, slots=True)
class Word:
    """The cluster autoscaler's latest event on a pod: its reason and message."""

    reason: str
    message: str


def autoscaler_word(events: Sequence[Event], uid: str | None) -> Word | None:
    """The autoscaler's latest TriggeredScaleUp or NotTriggerScaleUp on the pod of `uid`
    (an event of an earlier pod of the same name is not this one's), or None."""
    found = [
        event
        for event in events
        if event.reason in (TRIGGERED, NOT_TRIGGERED)
        and _component(event) in (None, "", AUTOSCALER)
        and (uid is None or event.involvedObject.uid in (None, uid))
    ]
    if not found:
        return None
    latest = max(found, key=_when)
    return Word(str(latest.reason), (latest.message or "")[:300])


async def wait_ready(
    created: Pod,
    changes: NextChange,
    events: Callable[[], Awaitable[list[Event]]],
    limits: Limits,
) -> str:
    """The pod's IP once it is Running and Ready, following `changes` (the pod each time
    it changes; None once deleted) and, while it is unschedulable, `events()` (the pod's).
    ProviderOutOfCapacity when it is still unschedulable at its bound, or the autoscaler
    cannot help it; ProviderError when it ends, goes, or will not start."""
    assert created.metadata is not None and created.metadata.name is not None
    name, uid = created.metadata.name, created.metadata.uid
    started = time.monotonic()
    pod: Pod | None = created
    scale_up: str | None = None  # the TriggeredScaleUp message, once read
    next_look = started  # when the events are read next, while unschedulable
    pull_failing_since: float | None = None
    while True:
        if pod is None:
            raise ProviderError(f"kubernetes: pod {name} was deleted while starting")
        now = objects.state(pod)
        if now.phase == "Running" and now.ready and now.ip:
            return now.ip
        if now.ended is not None or now.ending:
            raise ProviderError(f"kubernetes: pod {name} ended while starting: {now.ended}")
        if now.never_starts is not None:
            raise ProviderError(f"kubernetes: pod {name} will not start: {now.never_starts}")
        clock = time.monotonic()
        wake: float | None = None  # when to look again without a change heard
        if now.unschedulable is not None:
            schedule_end = started + limits.schedule
            if scale_up is None and clock >= min(next_look, schedule_end):
                word = autoscaler_word(await events(), uid)
                clock = time.monotonic()
                next_look = clock + EVENTS_EVERY_S
                if word is not None and word.reason == NOT_TRIGGERED:
                    raise ProviderOutOfCapacity(
                        f"pod unschedulable ({now.unschedulable}) and the cluster autoscaler "
                        f"cannot add a node for it: {word.message}"
                    )
                if word is not None:
                    scale_up = word.message
                    log.info("kubernetes: pod %s waits for a new node: %s", name, scale_up)
            end = started + (limits.scale_up if scale_up is not None else limits.schedule)
            if clock >= end:
                raise _unschedulable(now.unschedulable, scale_up, limits)
            wake = end if scale_up is not None else min(end, next_look)
        if now.pull_failing is not None:
            pull_failing_since = pull_failing_since or clock
            end = pull_failing_since + limits.image_pull
            if clock >= end:
                raise ProviderError(
                    f"kubernetes: pod {name} will not start: its image was not pulled within "
                    f"{limits.image_pull:g} s (K8S_IMAGE_PULL_TIMEOUT_SECONDS): "
                    f"{now.pull_failing}"
                )
            wake = end if wake is None else min(wake, end)
        heard, change = await changes.within(None if wake is None else max(0.0, wake - clock))
        if heard:
            pod = change  # else the same pod, looked at again at its bound


class NextChange:
    """The watch's next change, asked for once and kept across looks at the pod: a look
    that comes at a bound (the schedule's, the next read of the events) leaves it pending.
    Cancelling it instead would end the watch's generator for good (the cancellation is
    raised inside it), and the next ask of it would find it finished."""

    def __init__(self, changes: AsyncGenerator[Pod | None, None]) -> None:
        self.changes = changes
        self.pending: asyncio.Future[Pod | None] | None = None

    async def within(self, timeout: float | None) -> tuple[bool, Pod | None]:
        """(True, the change) once heard within `timeout` seconds, else (False, None)."""
        if self.pending is None:
            self.pending = asyncio.ensure_future(anext(self.changes))
        done, _ = await asyncio.wait({self.pending}, timeout=timeout)
        if not done:
            return False, None
        heard, self.pending = self.pending, None
        return True, heard.result()

    async def close(self) -> None:
        """The change still asked for is asked no more, and the watch ends."""
        if self.pending is not None:
            self.pending.cancel()
            await asyncio.gather(self.pending, return_exceptions=True)
            self.pending = None
        await self.changes.aclose()


def _unschedulable(why: str, scale_up: str | None, limits: Limits) -> ProviderOutOfCapacity:
    if scale_up is None:
        return ProviderOutOfCapacity(
            f"pod unschedulable after {limits.schedule:g} s (K8S_SCHEDULE_TIMEOUT_SECONDS): {why}"
        )
    return ProviderOutOfCapacity(
        f"pod unschedulable after {limits.scale_up:g} s (K8S_SCALE_UP_TIMEOUT_SECONDS), "
        f"waiting for the cluster autoscaler's new node ({scale_up}): {why}"
    )


def _component(event: Event) -> str | None:
    """Who recorded the event: `source.component` (core/v1), else `reportingComponent`
    (an event written through events.k8s.io/v1)."""
    return (event.source.component if event.source else None) or event.reportingComponent


def _when(event: Event) -> datetime.datetime:
    meta = event.metadata
    moment = event.lastTimestamp or event.eventTime or (meta.creationTimestamp if meta else None)
    return moment or _EPOCH
