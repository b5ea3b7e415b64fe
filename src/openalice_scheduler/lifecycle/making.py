"""Making a worker: the provider creates it, the scheduler waits until it answers
(providers/probe.py), and whatever a failure half-made is destroyed. One way, whether the
worker is made for a caller's lease or for the warm pool."""

from __future__ import annotations

import asyncio
import logging
import time

from openalice_scheduler.errors import ProviderError
from openalice_scheduler.lifecycle.core import Core
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.providers import Provider, Worker, WorkerSpec

# The service's lines, as ever (operators filter by logger name).
log = logging.getLogger("openalice_scheduler.service")


async def make_worker(core: Core, provider: Provider, spec: WorkerSpec) -> Worker:
    """The worker for `spec` on `provider`, created and ready. Still `provisioning` (or
    `warming`) meanwhile: a crash now is resolved as any other. On failure (a
    ProviderError, ProviderOutOfCapacity among them, or no worker within the provision
    timeout, raised as a ProviderError too) whatever it half-made is destroyed first."""
    started = time.perf_counter()
    try:
        worker = await asyncio.wait_for(provider.provision(spec), timeout=core.provision_timeout)
        core.metrics.provision_seconds.labels(provider.name).observe(time.perf_counter() - started)
        await core.probe.wait(provider.name, spec, worker, since=started)
    except TimeoutError:
        await destroy_quietly(provider, spec.lease_id)
        raise ProviderError(f"no worker after {core.provision_timeout:g} s") from None
    except ProviderError:
        await destroy_quietly(provider, spec.lease_id)  # a worker not ready too
        raise
    return worker


async def destroy_quietly(provider: Provider, lease_id: str, token: str = "") -> None:
    """Destroy a worker no lease holds (half-made, or made for a lease resolved
    meanwhile); one the provider cannot destroy yet is left to the reconciler, which
    destroys it as an orphan: it carries our labels."""
    try:
        await provider.release(token, lease_id)
    except ProviderError as exc:
        log.warning(
            "lease %s: could not clean up on %s yet: %s",
            lease_ref(lease_id),
            provider.name,
            exc.message,
        )
