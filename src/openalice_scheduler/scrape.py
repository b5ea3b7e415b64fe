"""What `/metrics` looks up when it is scraped: lease counts and whether the store
answers, and capacity and use per provider × kind × GPU class (the figures of
`GET /v1/providers`, from the same `capacity.provider_view`).

A scrape stays bounded in time. Use comes from the store (one grouped count, as for
/v1/providers). Capacity and health come from `provider.status()`, which does I/O (a
Docker ping, a RunPod catalog fetch): each provider is asked at most once per
STATUS_MAX_AGE_S, in a task of its own, and a scrape waits at most STATUS_WAIT_S for an
answer before serving the last one it had. Scraped every 15 s, a replica then asks RunPod
once a minute, not four times, and a hung Docker engine never holds a scrape past
Prometheus's own timeout."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Sequence

from openalice_scheduler.errors import StoreUnavailable
from openalice_scheduler.lifecycle import LeaseService
from openalice_scheduler.lifecycle.views import provider_view
from openalice_scheduler.metrics import ANY_KIND, Metrics
from openalice_scheduler.models import WorkerKind
from openalice_scheduler.providers import Provider, ProviderStatus

log = logging.getLogger(__name__)

STATUS_MAX_AGE_S = 60.0
STATUS_WAIT_S = 2.0

Held = Sequence[tuple[str, str, str, str | None, int]]


class Scrape:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._statuses: dict[str, ProviderStatus] = {}
        self._asked_at: dict[str, float] = {}  # monotonic time of the last status() call
        self._asking: dict[str, asyncio.Task[ProviderStatus]] = {}
        self._providers_expected = False

    async def render(self, service: LeaseService, *, owner_series: bool) -> bytes:
        """The Prometheus text, with the figures of this moment where they could be had
        and the last ones where not (better stale than a false zero)."""
        metrics = self.metrics
        if not self._providers_expected:
            metrics.expect_providers(p.name for p in service.providers)
            self._providers_expected = True
        await self._refresh_statuses(service.providers)
        counts: dict[str, int] | None = None
        owners: dict[str, int] | None = None
        try:
            counts = await service.store.count_by_state()
            held = await service.store.count_held()
            live_price = await service.store.live_price()
        except StoreUnavailable:
            metrics.store_up.set(0)
        else:
            metrics.store_up.set(1)
            self._set_capacity(service.providers, held)
            for provider in service.providers:
                metrics.live_cost.labels(provider.name).set(live_price.get(provider.name, 0.0))
            if service.guards is not None:
                contacts = await service.guards.contacts()
                # Set anew (no await in between): a guard forgotten, on any replica, loses
                # its series at the next scrape.
                metrics.guard_last_contact.clear()
                for contact in contacts:
                    metrics.guard_last_contact.labels(contact.guard_id).set(
                        contact.last_contact_at / 1e6
                    )
            # Owner ids on an ungated page only when the operator asks for them.
            if owner_series:
                owners = {}
                for _provider, _kind, _gpu, owner, count in held:
                    if owner is not None:
                        owners[owner] = owners.get(owner, 0) + count
        for name, status in self._statuses.items():
            metrics.provider_up.labels(name).set(1 if status.healthy else 0)
        return metrics.render(counts, owners)

    async def _refresh_statuses(self, providers: Sequence[Provider]) -> None:
        now = time.monotonic()
        for provider in providers:
            name = provider.name
            if name in self._asking or now - self._asked_at.get(name, -STATUS_MAX_AGE_S) < (
                STATUS_MAX_AGE_S
            ):
                continue
            self._asked_at[name] = now
            task = asyncio.create_task(provider.status(), name=f"status-{name}")
            self._asking[name] = task
            task.add_done_callback(functools.partial(self._answered, name))
        if self._asking:
            # Not cancelled when slow: the answer is kept for the next scrape.
            await asyncio.wait(list(self._asking.values()), timeout=STATUS_WAIT_S)

    def _answered(self, name: str, task: asyncio.Task[ProviderStatus]) -> None:
        self._asking.pop(name, None)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            log.warning("metrics: status of %s failed: %s", name, error)
            return
        self._statuses[name] = task.result()

    def _set_capacity(self, providers: Sequence[Provider], held: Held) -> None:
        """Every series set anew (no await from here on: a scrape never sees half)."""
        capacity, in_use = self.metrics.capacity, self.metrics.in_use
        capacity.clear()
        in_use.clear()
        for provider in providers:
            status = self._statuses.get(provider.name, ProviderStatus(healthy=False))
            view = provider_view(provider, status, held)
            name = provider.name
            if status.by_kind is None:
                # The kinds share each GPU class's cap: one capacity series (kind="any"),
                # and use per kind at 0 too, so that a graph does not end at the release.
                for gpu, figures in view["gpu"].items():
                    if figures["capacity"] is not None:
                        capacity.labels(name, ANY_KIND, gpu).set(figures["capacity"])
                    for kind in WorkerKind:
                        used = view["kinds"].get(kind.value, {}).get(gpu, {}).get("in_use", 0)
                        in_use.labels(name, kind.value, gpu).set(used)
                continue
            for kind, per_gpu in view["kinds"].items():
                for gpu, figures in per_gpu.items():
                    if figures["capacity"] is not None:
                        capacity.labels(name, kind, gpu).set(figures["capacity"])
                    in_use.labels(name, kind, gpu).set(figures["in_use"])
