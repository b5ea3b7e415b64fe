"""A Docker engine's event stream, as the deaths of this scheduler's containers
(docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out): each `die` event of a
container labelled with this SCHEDULER_INSTANCE is a WorkerEnded, OOM-killed when the engine said
`oom` for it (or its inspection says so). Docker sends `oom` before `die` as a rule, but from two
goroutines of containerd's shim: on a loaded host the `die` of an OOM kill may come first, and its
inspection then never says OOMKilled (Docker 20.10 writes that at the exit, only if the `oom` came
first; moby/moby#15621, #18510; seen in the emulators' tests). So the `die` of a SIGKILLed
container that has a memory limit of its own and is not said OOM-killed waits up to OOM_GRACE_S for
its `oom`; any other death is told at once.

The SDK's stream blocks, so it is read in a thread of its own for the stream's life and
handed to the event loop through a queue. A stream that breaks (the engine restarted,
its host unreachable) is opened again with backoff; each opening yields a Resync, so
that a listing finds what was missed meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import requests
from docker.errors import DockerException

from openalice_scheduler.errors import ProviderError
from openalice_scheduler.models import LostCause
from openalice_scheduler.providers.base import Resync, WorkerDeath, WorkerEnded
from openalice_scheduler.providers.docker.engine import (
    LABEL_INSTANCE,
    LABEL_LEASE,
    OOM_GRACE_S,
    SIGKILLED,
    DockerEngine,
    exited,
    oom_killed,
)

log = logging.getLogger(__name__)

# A stream that cannot be opened is tried again after this long, doubling.
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0


async def deaths(engine: DockerEngine) -> AsyncIterator[WorkerEnded | Resync]:
    """The deaths of `engine`'s containers of this scheduler, as they happen; a Resync
    each time the stream opens (first of all). Ends only when closed (cancelled)."""
    backoff = FIRST_BACKOFF_S
    while True:
        try:
            stream = await engine.run(_open, engine)
        except ProviderError as exc:
            log.debug("events of the Docker engine at %s: %s", engine.where, exc.message)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            continue
        backoff = FIRST_BACKOFF_S
        events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=_read, args=(stream, loop, events), name="docker-events", daemon=True
        ).start()
        try:
            yield Resync(engine.where)
            async with contextlib.aclosing(deaths_in(engine, events)) as told:
                async for ended in told:
                    yield ended
        finally:
            stream.close()  # ends the thread's read
        log.warning("the event stream of the Docker engine at %s ended; again", engine.where)


def _open(engine: DockerEngine) -> Any:
    return engine.client.api.events(
        decode=True,
        filters={
            "type": "container",
            "event": ["die", "oom"],
            "label": f"{LABEL_INSTANCE}={engine.instance}",
        },
    )


async def deaths_in(
    engine: DockerEngine, events: asyncio.Queue[dict[str, Any] | None]
) -> AsyncGenerator[WorkerEnded, None]:
    """The deaths the engine's events on `events` tell of, until None; a death held for
    its `oom` (OOM_GRACE_S) is told when that comes, else once the grace is over."""
    oom: set[str] = set()  # containers the engine said `oom` of, before their `die`
    held: dict[str, tuple[float, WorkerEnded]] = {}  # by container: its deadline, its death
    loop = asyncio.get_running_loop()
    while True:
        wait = min((deadline for deadline, _ in held.values()), default=None)
        try:
            event = await asyncio.wait_for(
                events.get(), None if wait is None else max(wait - loop.time(), 0)
            )
        except TimeoutError:
            for container_id in [c for c, (at, _) in held.items() if at <= loop.time()]:
                yield held.pop(container_id)[1]
            continue
        if event is None:
            break
        actor = event.get("Actor") or {}
        container_id = actor.get("ID") or ""
        if event.get("Action") == "oom":
            if container_id in held:
                told = held.pop(container_id)[1]
                yield WorkerEnded(told.lease_id, container_id, oom_killed(told.death.exit_code))
            else:
                oom.add(container_id)
            continue
        ended, may_be_oom = await _ended(engine, event, oom)
        if ended is None:
            continue
        if may_be_oom:
            held[container_id] = (loop.time() + OOM_GRACE_S, ended)
        else:
            yield ended
    for _, ended in held.values():  # the stream ended: told as they stand
        yield ended


async def _ended(
    engine: DockerEngine, event: Mapping[str, Any], oom: set[str]
) -> tuple[WorkerEnded | None, bool]:
    """The death a `die` event tells of, and whether it may yet be an OOM kill."""
    actor = event.get("Actor") or {}
    container_id, attributes = actor.get("ID") or "", actor.get("Attributes") or {}
    if event.get("Action") != "die" or not container_id:
        return None, False
    given = str(attributes.get("exitCode", ""))
    code = int(given) if given.isdigit() else None
    may_be_oom = False
    if container_id in oom:
        oom.discard(container_id)
        death = oom_killed(code)
    elif code == SIGKILLED:
        # Killed: its inspection tells whether by the OOM killer (or may yet, above).
        try:
            death, may_be_oom = await engine.run(engine.end_of, container_id, code)
        except ProviderError:
            death = WorkerDeath(LostCause.exited, code, "its container was killed")
    else:
        death = exited(code)
    return WorkerEnded(attributes.get(LABEL_LEASE), container_id, death), may_be_oom


def _read(
    stream: Any, loop: asyncio.AbstractEventLoop, events: asyncio.Queue[dict[str, Any] | None]
) -> None:
    """Each event of `stream` onto `events`, then None once it ends (closed, or broken)."""

    def put(event: dict[str, Any] | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
            loop.call_soon_threadsafe(events.put_nowait, event)

    try:
        for event in stream:
            put(event)
    except (DockerException, requests.RequestException, OSError, ValueError) as exc:
        log.debug("a Docker event stream broke: %s", exc)
    finally:
        put(None)
