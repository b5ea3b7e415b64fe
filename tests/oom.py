"""A real OOM kill, as Docker reports it, for the tests that make one.

The kernel's OOM killer ends a process past its container's memory limit; containerd's
shim hears of it through the container's memory cgroup, and Docker then says `oom` (an
event, and `State.OOMKilled`). The shim drops that word when the cgroup is already gone by
the time it looks, as it may be when the process killed was the container's only one and
its exit was handled first: containerd/containerd#8893 ("TaskOOM event lost"), whose
Kubernetes pod then says `Error` 137, not `OOMKilled` (kubernetes/kubernetes#119600). On
this 2-core host, 1 of 60 such kills made four at a time beside six busy loops had no
`oom`; none of 30 made one at a time beside three.

So what a system makes of an OOM kill Docker lost cannot be the OOM kill's outcome: a test
of the one Docker heard makes it again (at most ATTEMPTS times), and checks that the one
Docker lost ended as a plain kill does."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

from tests.harness import engine_events

ATTEMPTS = 3
# How long an `oom` may trail the end a test saw before Docker is taken to have lost it:
# the two come milliseconds apart when both come.
LATE_S = 5.0

T = TypeVar("T")


class Heard:
    """The containers Docker said `oom` of while the block ran."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._changed = threading.Condition()

    def add(self, container_id: str) -> None:
        with self._changed:
            self._ids.add(container_id)
            self._changed.notify_all()

    def of(self, container_id: str, timeout: float = LATE_S) -> bool:
        """Whether Docker said `oom` of `container_id`, waiting up to `timeout` for it."""
        with self._changed:
            return self._changed.wait_for(lambda: container_id in self._ids, timeout)


@contextlib.contextmanager
def docker_ooms() -> Iterator[Heard]:
    """The shared engine's `oom` events while the block runs (from the second it began:
    one sent while the stream was being opened is not missed)."""
    heard = Heard()
    oom = {"type": "container", "event": "oom"}
    with engine_events(oom, lambda event: heard.add(event["Actor"]["ID"]), int(time.time())):
        yield heard


def oom_kill_docker_hears(make: Callable[[], tuple[str, T]], lost: Callable[[T], None]) -> T:
    """`make()` OOM-kills a container for real and returns its id and what the system
    under test made of its end: that outcome, for the first kill Docker said `oom` of.
    `lost(outcome)` checks each one Docker lost, before the next is made."""
    for _ in range(ATTEMPTS):
        with docker_ooms() as heard:
            container_id, outcome = make()
            if heard.of(container_id):
                return outcome
        lost(outcome)
    pytest.fail(f"Docker said `oom` of none of {ATTEMPTS} containers OOM-killed for real")
