"""What every part of the lease's life shares: the store, the providers, the waiting
line, the clock, and the few things each part reports to (metrics, traces, the
sweeper's alarm). Made once by LeaseService and handed to its parts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentelemetry.trace import Tracer

from openalice_scheduler.handoff import HandOff
from openalice_scheduler.lease_access import LeaseAccess
from openalice_scheduler.lifecycle.admission import Budgets, FirstInLine, Priorities
from openalice_scheduler.lifecycle.clock import SYSTEM_CLOCK, Clock
from openalice_scheduler.lifecycle.line import LINE_TIMEOUT_S, Line
from openalice_scheduler.lifecycle.policy import Policy
from openalice_scheduler.metrics import Metrics
from openalice_scheduler.providers import InstantProvider, Provider
from openalice_scheduler.providers.probe import ReadyProbe
from openalice_scheduler.store import LeaseStore, to_us


@dataclass(eq=False)
class Core:
    store: LeaseStore
    providers: Sequence[Provider]
    policy: Policy
    metrics: Metrics
    tracer: Tracer
    probe: ReadyProbe
    access: LeaseAccess
    budgets: Budgets
    priorities: Priorities
    line: Line
    # A rule about time takes its time from here (tests move it).
    clock: Clock = SYSTEM_CLOCK
    # Called with the moment (µs) something new becomes due (the sweeper's alarm).
    on_due: Callable[[int], None] = lambda _at: None
    provision_timeout: float = 600.0
    max_leases_per_owner: int = 0
    # A replica silent this long is gone: its callers in line hold no one back.
    replica_timeout: float = 16.0
    # How long a preempted lease's worker runs on after its notice.
    preemption_grace: float = 30.0
    # Each full period waited lifts a caller one class up the line's order.
    line_aging: float = 120.0
    # A replica silent this long takes its callers in line with it.
    line_timeout: float = LINE_TIMEOUT_S
    # What tells workers of their lease (a preemption's notice); None: nobody tells them.
    notices: HandOff | None = None
    # Leases this process is provisioning (or handing off) right now: the reconciler
    # leaves them be.
    in_flight: set[str] = field(default_factory=set)

    # Called when the line may move (a new caller, a freed room): wakes the admission
    # loop where it runs (loops/admission.py), and this replica's callers' decisions
    # are read (acquiring.py).
    on_line: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.by_name = {p.name: p for p in self.providers}
        # Providers whose workers already exist: nothing to create or destroy.
        self.instant = tuple(p.name for p in self.providers if isinstance(p, InstantProvider))

    def now_us(self) -> int:
        return to_us(self.clock.now())

    def capacity_freed(self) -> None:
        """A lease stopped holding capacity (here, or on another replica as the store
        tells): the line may move."""
        self.wake_line()

    def wake_line(self) -> None:
        for call in self.on_line:
            call()

    def line_alive_since(self, now: int) -> int:
        """Callers of replicas heard from since then are in line."""
        return now - int(self.line_timeout * 1e6)

    def first_in_line(self) -> FirstInLine:
        """The terms of a reservation made outside the line: nobody may wait."""
        now = self.now_us()
        return FirstInLine(alive_since=self.line_alive_since(now), now=now)

    async def announce_freed(self) -> None:
        """Capacity may be free for a caller in line on any replica."""
        self.wake_line()
        await self.store.announce_capacity()

    async def announce_decided(self) -> None:
        """The admission loop decided on callers in line: their replicas read it."""
        self.wake_line()
        await self.store.announce_capacity()
