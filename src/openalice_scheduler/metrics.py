"""Prometheus metrics with the contract's names, on a registry of the app's own."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from openalice_scheduler import package_version
from openalice_scheduler.models import GpuClass, LostCause, ReleaseReason, WorkerKind

if TYPE_CHECKING:
    from openalice_scheduler.store.records import LeaseRecord

# `*_created` series double the output and no dashboard of ours reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]  # unannotated upstream

# Labels of `scheduler_capacity` for a provider whose kinds share one capacity (Docker,
# RunPod): the cap is per GPU class, whatever the kind.
ANY_KIND = "any"
ACQUIRE_FAILURE_REASONS = ("no_provider", "provision_failed", "quota", "budget", "line_full")
# How a caller's wait in line ended (`scheduler_wait_seconds{outcome}`): with a worker,
# out of time while still at capacity, the caller hung up, or refused for another reason
# (not capacity, an error, shutting down).
WAIT_OUTCOMES = ("served", "timeout", "gone", "refused")


class Metrics:
    def __init__(self, *, owner_series: bool = False) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds ...
        # and python_info: on this registry, as the default one is not served.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.up = Gauge("scheduler_up", "1 while the scheduler serves.", registry=r)
        self.build_info = Gauge(
            "scheduler_build_info",
            "1, labelled with the running version.",
            ["version"],
            registry=r,
        )
        self.active_leases = Gauge(
            "scheduler_active_leases", "Leases whose worker is live.", registry=r
        )
        self.providers = Gauge("scheduler_providers", "Configured providers.", registry=r)
        self.acquired = Counter(
            "scheduler_leases_acquired",
            "Leases handed out.",
            ["provider", "kind", "gpu"],
            registry=r,
        )
        self.acquire_failures = Counter(
            "scheduler_acquire_failures",
            "Acquires that gave no lease, by reason.",
            ["reason"],
            registry=r,
        )
        self.released = Counter(
            "scheduler_leases_released",
            "Leases ended, by reason.",
            ["provider", "reason"],
            registry=r,
        )
        self.spend = Counter(
            "scheduler_spend_dollars",
            "USD that ended leases cost (price per hour × time "
            "held), by provider; each replica counts the leases it ended.",
            ["provider"],
            registry=r,
        )
        # Owner ids on the ungated /metrics only when the operator asks (METRICS_OWNER_SERIES).
        self.owner_spend = (
            Counter(
                "scheduler_owner_spend_dollars",
                "USD that ended leases cost, by owner.",
                ["owner"],
                registry=r,
            )
            if owner_series
            else None
        )
        self.live_cost = Gauge(
            "scheduler_live_cost_per_hour_dollars",
            "USD per hour that live leases cost "
            "now (provisioning, active, releasing), by provider.",
            ["provider"],
            registry=r,
        )
        self.provision_seconds = Histogram(
            "scheduler_provision_seconds",
            "Time a provider took to make a worker.",
            ["provider"],
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
        )
        self.ready_seconds = Histogram(
            "scheduler_ready_seconds",
            "Time from the start of a provision to the worker "
            "passing its readiness probe (probed workers only).",
            ["provider"],
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 900),
        )
        self.release_failures = Counter(
            "scheduler_release_failures",
            "Release attempts a provider did not confirm.",
            ["provider"],
            registry=r,
        )
        self.pool_idle = Gauge(
            "scheduler_pool_idle",
            "Idle, ready warm-pool workers (WARM_POOL).",
            ["kind", "gpu"],
            registry=r,
        )
        self.pool_target = Gauge(
            "scheduler_pool_target",
            "Idle and warming workers a warm pool keeps now (its demand, buffer, bounds and "
            "money caps), on the replica that sizes the pools; 0 on the others (read with max).",
            ["kind", "gpu"],
            registry=r,
        )
        self.pool_hits = Counter(
            "scheduler_pool_hits",
            "Acquires a warm pool served with a ready worker.",
            ["kind", "gpu"],
            registry=r,
        )
        self.pool_misses = Counter(
            "scheduler_pool_misses",
            "Acquires a warm pool would serve that found none ready and went cold.",
            ["kind", "gpu"],
            registry=r,
        )
        self.pool_idle_seconds = Counter(
            "scheduler_pool_idle_worker_seconds",
            "Seconds warm-pool workers spent idle, summed over workers (counted by the "
            "replica that sizes the pools).",
            ["kind", "gpu"],
            registry=r,
        )
        self.pool_idle_cost = Counter(
            "scheduler_pool_idle_cost_dollars",
            "What warm-pool workers cost while idle or warming, USD at their pool's price "
            "(counted by the replica that sizes the pools).",
            ["kind", "gpu"],
            registry=r,
        )
        self.releasing = Gauge(
            "scheduler_leases_releasing", "Releases still being retried.", registry=r
        )
        # Capacity and use as GET /v1/providers shows them, set at scrape time (scrape.py).
        self.capacity = Gauge(
            "scheduler_capacity",
            'Most workers a provider holds at once, per kind (kind="any": shared by the '
            "kinds) and GPU class; no series where it has no fixed cap.",
            ["provider", "kind", "gpu"],
            registry=r,
        )
        self.in_use = Gauge(
            "scheduler_in_use",
            "Live leases (provisioning, active, releasing) per provider, kind and GPU class.",
            ["provider", "kind", "gpu"],
            registry=r,
        )
        self.provider_up = Gauge(
            "scheduler_provider_up",
            "1 when the provider's last health check passed.",
            ["provider"],
            registry=r,
        )
        self.store_up = Gauge(
            "scheduler_store_up", "1 when the state store answered this scrape.", registry=r
        )
        self.waiting = Gauge(
            "scheduler_waiting_callers",
            "Acquires waiting in line for capacity.",
            ["kind", "gpu"],
            registry=r,
        )
        self.wait_seconds = Histogram(
            "scheduler_wait_seconds",
            "Time an acquire waited in line, by how it ended.",
            ["outcome"],
            registry=r,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
        )
        # The same, per priority class (docs/concepts/priorities.md#priorities-and-preemption).
        self.class_waiting = Gauge(
            "scheduler_waiting_callers_per_class",
            "Acquires waiting in line for capacity, per priority class.",
            ["priority_class"],
            registry=r,
        )
        self.class_wait_seconds = Histogram(
            "scheduler_wait_seconds_per_class",
            "Time an acquire waited in line, per priority class and how it ended.",
            ["priority_class", "outcome"],
            registry=r,
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
        )
        self.workers_lost = Counter(
            "scheduler_workers_lost",
            "Workers that stopped after their hand-out (their lease ended `lost`, an idle "
            "pool worker recycled), by provider and cause "
            "(docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out).",
            ["provider", "cause"],
            registry=r,
        )
        self.preemptions = Counter(
            "scheduler_preemptions",
            "Leases displaced for a caller of a higher class, by the victim's class.",
            ["victim_class"],
            registry=r,
        )
        self.admission_leader = Gauge(
            "scheduler_admission_leader",
            "1 on the replica whose admission loop decides who gets a room, else 0.",
            registry=r,
        )
        self.admission_pass_seconds = Histogram(
            "scheduler_admission_pass_seconds",
            "Time of one pass of the admission loop over the whole line.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.admission_decisions = Counter(
            "scheduler_admission_decisions",
            "Callers in line the admission loop granted a room or refused.",
            registry=r,
        )
        self.capacity_refusals = Counter(
            "scheduler_capacity_refusals",
            "Acquires refused because every provider that could serve them was at its cap.",
            ["kind", "gpu"],
            registry=r,
        )
        self.sweep_last_success = Gauge(
            "scheduler_sweep_last_success_timestamp_seconds",
            "Unix time the sweeper last finished a pass.",
            registry=r,
        )
        # Set at scrape time from the store (scrape.py): every replica shows every guard.
        self.guard_last_contact = Gauge(
            "scheduler_guard_last_contact_timestamp_seconds",
            "Unix time each guard (openalice-scheduler guard) last polled any replica.",
            ["guard"],
            registry=r,
        )
        self.reconcile_last_success = Gauge(
            "scheduler_reconcile_last_success_timestamp_seconds",
            "Unix time this replica last finished a reconciliation (one replica at a time "
            "reconciles: take the max over replicas).",
            registry=r,
        )
        # Observed by the access middleware (api/access.py) for every HTTP answer. `route`
        # is the route template (`unmatched` for a path no route serves) and `method` one
        # of the standard ones or `other`: the callers cannot grow the label sets.
        self.http_request_duration = Histogram(
            "scheduler_http_request_duration_seconds",
            "Time to answer an HTTP request, by route template, method and status.",
            ["route", "method", "status"],
            registry=r,
            buckets=(
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
                30,
                60,
                300,
                600,
            ),
        )
        # Registered on first use: only with METRICS_OWNER_SERIES, as /metrics is ungated
        # and owner ids are the callers' to show.
        self.owner_leases: Gauge | None = None
        self.up.set(1)
        self.build_info.labels(package_version()).set(1)
        # Series at 0 from the start, so that rate() and alerts see the first event.
        for reason in ACQUIRE_FAILURE_REASONS:
            self.acquire_failures.labels(reason)
        for outcome in WAIT_OUTCOMES:
            self.wait_seconds.labels(outcome)
        for kind in WorkerKind:
            for gpu in GpuClass:
                self.waiting.labels(kind.value, gpu.value)
                self.capacity_refusals.labels(kind.value, gpu.value)

    def expect_providers(self, names: Iterable[str]) -> None:
        """Per-provider series at 0 until something happens on that provider."""
        for name in names:
            self.provision_seconds.labels(name)
            self.release_failures.labels(name)
            self.spend.labels(name)
            for reason in ReleaseReason:
                self.released.labels(name, reason.value)
            for cause in LostCause:
                self.workers_lost.labels(name, cause.value)

    def spent(self, record: LeaseRecord) -> None:
        """A lease ended: what it cost goes on the spend counters."""
        if not record.cost:
            return
        self.spend.labels(record.provider).inc(record.cost)
        if self.owner_spend is not None and record.owner_id is not None:
            self.owner_spend.labels(record.owner_id).inc(record.cost)

    # --- the waiting line (lifecycle/line.py) -------------------------------------------------

    def wait_began(self, kind: str, gpu: str, priority_class: str) -> None:
        self.waiting.labels(kind, gpu).inc()
        self.class_waiting.labels(priority_class).inc()

    def wait_ended(
        self, kind: str, gpu: str, priority_class: str, outcome: str, seconds: float
    ) -> None:
        self.waiting.labels(kind, gpu).dec()
        self.wait_seconds.labels(outcome).observe(seconds)
        self.class_waiting.labels(priority_class).dec()
        self.class_wait_seconds.labels(priority_class, outcome).observe(seconds)

    def expect_classes(self, names: Iterable[str]) -> None:
        """Per-class series at 0 until someone of that class waits (or is preempted)."""
        for name in names:
            self.preemptions.labels(name)
            self.class_waiting.labels(name)
            for outcome in WAIT_OUTCOMES:
                self.class_wait_seconds.labels(name, outcome)

    def refused_at_capacity(self, kind: str, gpu: str) -> None:
        self.capacity_refusals.labels(kind, gpu).inc()

    # --- scrape ------------------------------------------------------------------------

    def render(self, counts: dict[str, int] | None, owners: dict[str, int] | None = None) -> bytes:
        """Prometheus text; `counts` by lease state and live leases per owner, or None
        to keep the last figures (the store is unreachable: better stale than a false
        zero). `scheduler_owner_leases` is served once `owners` has been given."""
        if counts is not None:
            self.active_leases.set(counts.get("active", 0))
            self.releasing.set(counts.get("releasing", 0))
        if owners is not None:
            if self.owner_leases is None:
                self.owner_leases = Gauge(
                    "scheduler_owner_leases",
                    "Live leases (provisioning, active, releasing) per owner.",
                    ["owner"],
                    registry=self.registry,
                )
            self.owner_leases.clear()
            for owner, count in owners.items():
                self.owner_leases.labels(owner).set(count)
        return generate_latest(self.registry)
