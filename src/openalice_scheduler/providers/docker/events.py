"""A Docker engine's event stream, as the deaths of this scheduler's containers
(docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out): each `die` event of a
container labelled with this SCHEDULER_INSTANCE is a WorkerEnded, OOM-killed when the engine said
`oom` for it (or its inspection says so: Docker sends `oom` before `die`, but nothing promises it).

The SDK's stream blocks, so it is read in a thread of its own for the stream's life and
handed to the event loop through a queue. A stream that breaks (the engine restarted,
its host unreachable) is opened again with backoff; each opening yields a Resync, so
that a listing finds what was missed meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Mapping
from typing import Any

import requests
from docker.errors import DockerException

from openalice_scheduler.errors import ProviderError
from openalice_scheduler.models import LostCause
from openalice_scheduler.providers.base import Resync, WorkerDeath, WorkerEnded
from openalice_scheduler.providers.docker.engine import LABEL_INSTANCE, LABEL_LEASE, DockerEngine

log = logging.getLogger(__name__)

# A stream that cannot be opened is tried again after this long, doubling.
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 10.0
# The exit code of a process killed by SIGKILL (128 + 9): the OOM killer's, among others.
SIGKILLED = 137


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
            oom: set[str] = set()  # containers the engine said `oom` of, before their `die`
            while (event := await events.get()) is not None:
                ended = await _ended(engine, event, oom)
                if ended is not None:
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


async def _ended(
    engine: DockerEngine, event: Mapping[str, Any], oom: set[str]
) -> WorkerEnded | None:
    actor = event.get("Actor") or {}
    container_id, attributes = actor.get("ID") or "", actor.get("Attributes") or {}
    action = event.get("Action")
    if action == "oom":
        oom.add(container_id)
        return None
    if action != "die" or not container_id:
        return None
    given = str(attributes.get("exitCode", ""))
    code = int(given) if given.isdigit() else None
    if container_id in oom:
        oom.discard(container_id)
        death = WorkerDeath(LostCause.oom_killed, code, "the kernel's OOM killer ended it")
    elif code == SIGKILLED:
        # Killed: its inspection tells whether by the OOM killer.
        try:
            death = await engine.run(engine.death_of, container_id, code)
        except ProviderError:
            death = WorkerDeath(LostCause.exited, code, "its container was killed")
    else:
        death = WorkerDeath(LostCause.exited, code, f"its container exited with code {code}")
    return WorkerEnded(attributes.get(LABEL_LEASE), container_id, death)


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
