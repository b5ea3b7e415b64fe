"""Readiness probes: a new worker is handed out only once it answers
(docs/concepts/readiness-and-loss.md#workers-ready-when-handed-out). A container that started, or a
pod RunPod calls RUNNING, may still be pulling its image or starting its process for minutes.

Per worker kind, the probe is an HTTP GET of RENDERER_READY_PATH / ANIM_READY_PATH
answered 2xx or, when unset, a TCP connect to the worker's port (behind a proxy or a
tunnel, which accepts connections whether or not the worker listens: any answer of the
worker's own). Per provider, a worker has its provider's ready timeout to pass it, from
the one table of providers (`providers.ready_timeouts`: LOCAL_DOCKER_, RUNPOD_, MODAL_,
K8S_READY_TIMEOUT_SECONDS; 0: not probed). The service waits here between the provider's
provision and the lease's activation; what happens to a worker that never gets ready is
the service's rule."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import NamedTuple
from urllib.parse import urlsplit

import httpx
from prometheus_client import Histogram

from openalice_scheduler.config import Settings
from openalice_scheduler.errors import ProviderError
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.providers import ready_timeouts
from openalice_scheduler.providers.base import Worker, WorkerSpec

log = logging.getLogger(__name__)

# Polled soon after the worker exists (busybox listens within milliseconds), then less
# often: a pod pulling an image for minutes is looked at once a second.
FIRST_INTERVAL_S = 0.02
MAX_INTERVAL_S = 1.0
# One attempt's bound: a worker that takes longer to answer is not ready yet.
ATTEMPT_TIMEOUT_S = 2.0
# What a proxy answers while the worker behind it does not (RunPod's: 502).
PROXY_NOT_THERE = frozenset({502, 503, 504})


class NotReady(ProviderError):
    """The worker did not pass its probe in time (the service destroys it)."""


class Seen(NamedTuple):
    """What one attempt saw instead of a ready worker; `timed_out` when what it saw was its
    own time running out (no answer yet)."""

    what: str
    timed_out: bool


class ReadyProbe:
    """Waits until a new worker passes its kind's probe, within its provider's time."""

    def __init__(
        self,
        paths: Mapping[str, str | None],
        timeouts: Mapping[str, float],
        seconds: Histogram | None = None,
        *,
        others: float | None = None,
    ) -> None:
        self.paths = dict(paths)
        self.timeouts = dict(timeouts)
        # The timeout of a provider not in `timeouts`: None, none may be missing.
        self.others = others
        self.seconds = seconds
        self._client: httpx.AsyncClient | None = None

    @classmethod
    def from_settings(cls, settings: Settings, seconds: Histogram | None = None) -> ReadyProbe:
        """Every registered provider's timeout, from its own setting."""
        return cls(settings.ready_paths, ready_timeouts(settings), seconds)

    @classmethod
    def off(cls) -> ReadyProbe:
        """No worker probed (a service made in-process, without settings)."""
        return cls({}, {}, others=0.0)

    def timeout(self, provider: str) -> float:
        """How long `provider`'s new worker has to pass its probe (0: not probed)."""
        timeout = self.timeouts.get(provider, self.others)
        if timeout is None:
            raise LookupError(f"provider {provider!r} has no ready timeout (providers.REGISTRY)")
        return timeout

    @property
    def longest(self) -> float:
        """The longest any provider's worker may be probed: a lease may stay
        `provisioning` that much longer than PROVISION_TIMEOUT_SECONDS."""
        return max(self.timeouts.values(), default=0.0)

    async def wait(self, provider: str, spec: WorkerSpec, worker: Worker, since: float) -> None:
        """Returns once `worker` answered its probe (at once when `provider`'s workers are
        not probed); raises NotReady when it did not within the provider's time.
        `since` (perf_counter) is when provisioning began: the time to ready observed."""
        timeout = self.timeout(provider)
        if timeout <= 0:
            return
        url = worker.probe_url or worker.endpoint
        path = self.paths.get(spec.kind.value)
        deadline = time.monotonic() + timeout
        interval = FIRST_INTERVAL_S
        told: str | None = None  # what the caller is told if the worker never gets ready
        while True:
            left = deadline - time.monotonic()
            budget = max(0.05, min(ATTEMPT_TIMEOUT_S, left))
            seen = await self._attempt(url, path, worker.behind_proxy, budget)
            if seen is None:
                break
            # An attempt the deadline cut short, timed out, says less of the worker than the
            # answer before it (a health path's 404 from a worker that is slow to answer).
            if told is None or not (seen.timed_out and budget < ATTEMPT_TIMEOUT_S):
                told = seen.what
            left = deadline - time.monotonic()
            if left <= 0:
                raise NotReady(f"worker not ready after {timeout:g} s ({told})")
            await asyncio.sleep(min(interval, left))
            interval = min(interval * 2, MAX_INTERVAL_S)
        took = time.perf_counter() - since
        if self.seconds is not None:
            self.seconds.labels(provider).observe(took)
        log.info(
            "lease %s: worker on %s ready %.2f s after provisioning began",
            lease_ref(spec),
            provider,
            took,
        )

    async def check(self, kind: str, url: str) -> str | None:
        """One attempt of `kind`'s probe at `url`: None when the worker answers as ready,
        else what was seen (an idle warm-pool worker's periodic check, pool.py)."""
        seen = await self._attempt(url, self.paths.get(kind), False, ATTEMPT_TIMEOUT_S)
        return None if seen is None else seen.what

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def _attempt(
        self, url: str, path: str | None, behind_proxy: bool, budget: float
    ) -> Seen | None:
        """None when the worker answered as ready, else what was seen instead."""
        if path is None and not behind_proxy:
            return await _connect(url, budget)
        target = url.rstrip("/") + (path or "/")
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False)
        try:
            response = await self._client.get(target, timeout=budget)
        except httpx.HTTPError as exc:
            timed_out = isinstance(exc, httpx.TimeoutException)
            return Seen(f"GET {target}: {type(exc).__name__}", timed_out)
        # Behind a proxy, with no path to ask: any answer of the worker's own will do.
        ok = response.status_code not in PROXY_NOT_THERE if path is None else response.is_success
        return None if ok else Seen(f"GET {target}: {response.status_code}", False)


async def _connect(url: str, budget: float) -> Seen | None:
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), budget)
    except (OSError, TimeoutError) as exc:
        return Seen(f"TCP {host}:{port}: {type(exc).__name__}", isinstance(exc, TimeoutError))
    writer.close()
    with contextlib.suppress(OSError):  # closed by the worker: it did accept, all the same
        await writer.wait_closed()
    return None
