"""What every part of the lease's life shares: the store, the providers, the waiting
line, the clock, and the few things each part reports to (metrics, traces, the
sweeper's alarm). Made once by LeaseService and handed to its parts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from opentelemetry.trace import Tracer

from openalice_scheduler.handoff import HandOff
from openalice_scheduler.lease_access import LeaseAccess
from openalice_scheduler.lifecycle.admission import Budgets, InLine, Priorities
from openalice_scheduler.lifecycle.clock import SYSTEM_CLOCK, Clock
from openalice_scheduler.lifecycle.line import CapacityQueue, Waiter
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
    line: CapacityQueue
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
    # What tells workers of their lease (a preemption's notice); None: nobody tells them.
    notices: HandOff | None = None
    # Leases this process is provisioning (or handing off) right now: the reconciler
    # leaves them be.
    in_flight: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.by_name = {p.name: p for p in self.providers}
        # Providers whose workers already exist: nothing to create or destroy.
        self.instant = tuple(p.name for p in self.providers if isinstance(p, InstantProvider))

    def now_us(self) -> int:
        return to_us(self.clock.now())

    def capacity_freed(self) -> None:
        """A lease stopped holding capacity: the first acquire waiting for some tries."""
        self.line.freed()

    def in_line(self, caller: Waiter) -> InLine:
        """Where `caller` stands in the line, for a reservation's admission: among the
        callers of replicas heard from within the replica timeout."""
        now = self.now_us()
        return InLine(
            priority=caller.priority,
            arrived_at=caller.arrived_at,
            waiter_id=caller.waiter_id,
            claims=caller.claims,
            alive_since=now - int(self.replica_timeout * 1e6),
            now=now,
        )

    async def announce_freed(self) -> None:
        """Capacity may be free for a caller in line on any replica: each replica's
        first waiter tries (here at once, elsewhere as the store tells them)."""
        self.line.freed()
        await self.store.announce_capacity()
