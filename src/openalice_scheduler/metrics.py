"""Prometheus metrics with the contract's names, on a registry of the app's own."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# `*_created` series double the output and no dashboard of ours reads them.
disable_created_metrics()


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.up = Gauge("scheduler_up", "1 while the scheduler serves.", registry=r)
        self.active_leases = Gauge(
            "scheduler_active_leases", "Leases whose worker is live.", registry=r
        )
        self.providers = Gauge("scheduler_providers", "Configured providers.", registry=r)
        self.acquired = Counter(
            "scheduler_leases_acquired", "Leases handed out.",
            ["provider", "kind", "gpu"], registry=r,
        )
        self.acquire_failures = Counter(
            "scheduler_acquire_failures", "Acquires that gave no lease, by reason.",
            ["reason"], registry=r,
        )
        self.released = Counter(
            "scheduler_leases_released", "Leases ended, by reason.",
            ["provider", "reason"], registry=r,
        )
        self.provision_seconds = Histogram(
            "scheduler_provision_seconds", "Time a provider took to make a worker.",
            ["provider"], registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
        )
        self.release_failures = Counter(
            "scheduler_release_failures", "Release attempts a provider did not confirm.",
            ["provider"], registry=r,
        )
        self.releasing = Gauge(
            "scheduler_leases_releasing", "Releases still being retried.", registry=r
        )
        # Registered on first use: only with METRICS_OWNER_SERIES, as /metrics is ungated
        # and owner ids are the callers' to show.
        self.owner_leases: Gauge | None = None
        self.up.set(1)

    def render(
        self, counts: dict[str, int] | None, owners: dict[str, int] | None = None
    ) -> bytes:
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
                    ["owner"], registry=self.registry,
                )
            self.owner_leases.clear()
            for owner, count in owners.items():
                self.owner_leases.labels(owner).set(count)
        return generate_latest(self.registry)
