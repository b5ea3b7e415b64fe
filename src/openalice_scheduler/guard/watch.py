"""The guard's loop: every GUARD_POLL_SECONDS, learn from a scheduler, look at the
workers, and act only when no scheduler has answered for GUARD_SILENCE_SECONDS.

A poll counts as an answer only when a replica answers `GET /v1/guard` with 200: a
replica whose store is down answers 503 and cannot sweep either, and a gateway's 502
is not a scheduler. While a scheduler answers, the guard destroys nothing: the sweeper
and the reconciler are the first line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from openalice_scheduler.client.core import LIMITS
from openalice_scheduler.errors import ProviderError
from openalice_scheduler.guard.memory import Memory
from openalice_scheduler.logs import lease_ref
from openalice_scheduler.models import MAX_TTL_SECONDS
from openalice_scheduler.providers import PartialListing, Provider, WorkerInfo

log = logging.getLogger(__name__)


class Guard:
    def __init__(
        self,
        *,
        guard_id: str,
        urls: Sequence[str],
        secret: str,
        providers: Sequence[Provider],
        state_file: Path,
        poll: float,
        silence: float,
        grace: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.guard_id = guard_id
        self.urls = [u.rstrip("/") for u in urls]
        self.providers = list(providers)
        self.state_file = state_file
        self.poll, self.silence, self.grace = poll, silence, grace
        self.clock = clock
        self.memory = Memory.load(state_file, clock())
        self.client = httpx.AsyncClient(
            timeout=min(poll, 10.0),
            follow_redirects=False,
            headers={"X-Internal-Secret": secret},
            limits=LIMITS,  # a poll never reuses a connection the scheduler is closing
        )
        self._said_silent = False

    async def run(self, stop: asyncio.Event) -> None:
        log.info(
            "guard %s watching %s for %s; silence %gs, grace %gs, poll %gs",
            self.guard_id,
            ",".join(p.name for p in self.providers),
            ", ".join(self.urls),
            self.silence,
            self.grace,
            self.poll,
        )
        while not stop.is_set():
            try:
                await self.once()
            except Exception:  # noqa: BLE001 - the guard must outlive any one pass
                log.exception("guard pass failed; trying again in %gs", self.poll)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.poll)

    async def once(self) -> int:
        """One pass; the number of workers destroyed."""
        answer = await self._contact()
        now = self.clock()
        if answer is not None:
            self.memory.learn(answer, now)
            if self._said_silent:
                log.info("guard %s: a scheduler answers again; standing down", self.guard_id)
                self._said_silent = False
        listed, complete = await self._workers()
        self.memory.saw(set(listed), now, complete=complete)
        destroyed = 0
        silent = self.memory.silent_for(now)
        if silent >= self.silence:
            if not self._said_silent:
                log.warning(
                    "guard %s: no scheduler has answered for %.0fs; destroying "
                    "workers past their lease + %gs",
                    self.guard_id,
                    silent,
                    self.grace,
                )
                self._said_silent = True
            for lease_id, found in sorted(listed.items()):
                when = self.memory.deadline(
                    lease_id, grace=self.grace, default_max_ttl=MAX_TTL_SECONDS
                )
                if now >= when:
                    destroyed += await self._destroy(lease_id, found, when)
        self.memory.save(self.state_file)
        return destroyed

    async def close(self) -> None:
        await self.client.aclose()
        for provider in self.providers:
            await provider.close()

    async def _contact(self) -> dict[str, Any] | None:
        """The first replica's answer to the poll, or None when none answered."""
        params = {"guard_id": self.guard_id, "providers": ",".join(p.name for p in self.providers)}
        for url in self.urls:
            try:
                response = await self.client.get(f"{url}/v1/guard", params=params)
            except httpx.HTTPError as exc:
                log.debug("guard: %s did not answer (%s)", url, type(exc).__name__)
                continue
            if response.status_code == 200:
                answer: dict[str, Any] = response.json()
                if self.memory.instance not in (
                    None,
                    answer["instance"],
                ) or self.memory.store_id not in (None, answer["store_id"]):
                    log.error(
                        "guard: %s serves instance %s of store %s, not the one this "
                        "guard watched (GUARD_STATE_FILE); not learned from",
                        url,
                        answer["instance"],
                        answer["store_id"],
                    )
                    continue
                return answer
            # Said each time, as the guard is then blind: 401 a wrong secret, 422 a
            # provider that scheduler does not run, 429 no room for another guard there
            # (MAX_GUARDS). Others: a replica without its store, or a gateway without one.
            if response.status_code in (401, 403, 422, 429):
                log.error("guard: %s refused it: %s", url, _why(response))
            else:
                log.debug("guard: %s answered %d", url, response.status_code)
        return None

    async def _workers(self) -> tuple[dict[str, list[tuple[Provider, WorkerInfo]]], bool]:
        """This store's workers on every provider, by lease id; whether all answered."""
        found: dict[str, list[tuple[Provider, WorkerInfo]]] = {}
        complete = True
        for provider in self.providers:
            try:
                workers = await provider.list_workers()
            except ProviderError as exc:
                log.warning("guard: cannot list %s's workers: %s", provider.name, exc.message)
                complete = False
                continue
            if isinstance(workers, PartialListing):
                complete = False  # a fleet host did not answer: its workers are unknown
            store_id = self.memory.store_id
            for lease_id, infos in (workers or {}).items():
                # Another store's workers under the same instance name are left alone.
                mine = [i for i in infos if store_id is None or i.store_id in (None, store_id)]
                if mine:
                    found.setdefault(lease_id, []).extend((provider, i) for i in mine)
        return found, complete

    async def _destroy(
        self, lease_id: str, found: list[tuple[Provider, WorkerInfo]], when: float
    ) -> int:
        """Destroy the workers of `lease_id`; one that could not be is tried again next
        pass (it is still listed then)."""
        destroyed = 0
        since = datetime.fromtimestamp(when - self.grace, UTC).strftime("%H:%M:%SZ")
        for provider, info in found:
            if info.ending:
                continue  # already asked to go (a pod in its grace period): once is enough
            try:
                await provider.release(info.provider_token, lease_id)
            except ProviderError as exc:
                log.warning(
                    "guard: could not destroy the worker of lease %s on %s yet: %s",
                    lease_ref(lease_id),
                    provider.name,
                    exc.message,
                )
                continue
            log.warning(
                "guard: destroyed the worker of lease %s on %s (its lease ended "
                "by %s; no scheduler answers)",
                lease_ref(lease_id),
                provider.name,
                since,
            )
            destroyed += 1
        return destroyed


def _why(response: httpx.Response) -> str:
    """A refusal's status and the scheduler's message (which never holds a secret)."""
    try:
        body = response.json()
    except ValueError:  # a proxy's page, say
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    return (
        f"{response.status_code} {message}"
        if isinstance(message, str)
        else str(response.status_code)
    )
