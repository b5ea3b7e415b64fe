"""The deaths of this scheduler's pods, from one watch of the namespace
(docs/concepts/readiness-and-loss.md#a-worker-lost-after-its-hand-out), as a controller follows its
pods: list the pods with this SCHEDULER_INSTANCE's label, then watch from the list's
resourceVersion. A pod whose worker stopped for good (objects.death: its container terminated,
OOM-killed, evicted, its node lost, its deadline reached, the pod deleted) is a WorkerEnded.

A watch the API server ends (its timeout) is made again by lightkube from the last
version heard; a version too old to watch from (410 Expired, in the stream as an ERROR
event or as an answer) is listed again; any other refusal (403, 429, 5xx, the connection
lost) is tried again with backoff. Each listing yields a Resync: what a gap in the watch
missed is for the reconciler's listing to find."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Pod
from lightkube.types import OnErrorAction, OnErrorResult

from openalice_scheduler.errors import ProviderError
from openalice_scheduler.providers.base import Resync, WorkerEnded
from openalice_scheduler.providers.kubernetes import objects
from openalice_scheduler.providers.kubernetes.objects import LABEL_INSTANCE, LABEL_LEASE

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


async def deaths(
    connect: Callable[[], AsyncClient], namespace: str, instance: str
) -> AsyncIterator[WorkerEnded | Resync]:
    """Each death of a pod of `instance` in `namespace`, as the watch tells it; a Resync
    at each listing (first of all). Ends only when closed (cancelled)."""
    labels: dict[str, Any] = {LABEL_INSTANCE: instance}
    backoff = FIRST_BACKOFF_S
    while True:
        try:
            client = connect()
            listing = client.list(Pod, namespace=namespace, labels=labels)
            async for _ in listing:
                pass  # the reconciler judges what is there now; the watch, what comes
            version = listing.resourceVersion
            yield Resync(f"kubernetes namespace {namespace}")
            backoff = FIRST_BACKOFF_S
            async for kind, pod in client.watch(
                Pod,
                namespace=namespace,
                labels=labels,
                resource_version=version,
                on_error=on_watch_error,
            ):
                ended = _ended(kind, pod)
                if ended is not None:
                    yield ended
        except httpx.HTTPStatusError as exc:  # ApiError among them
            if status_code(exc) == 410:
                log.info("kubernetes: the pod watch's version expired; listing again")
                continue
            log.warning(
                "kubernetes: the pod watch was refused (%s); again in %.1f s",
                refusal(exc),
                backoff,
            )
        except (httpx.TransportError, ProviderError) as exc:
            log.warning("kubernetes: the pod watch failed (%s); again in %.1f s", exc, backoff)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF_S)


def _ended(kind: str, pod: Pod) -> WorkerEnded | None:
    meta = pod.metadata
    if meta is None or meta.name is None:
        return None
    death = objects.death(pod, deleted=kind == "DELETED")
    if death is None:
        return None
    return WorkerEnded((meta.labels or {}).get(LABEL_LEASE), meta.name, death)


def transient(exc: Exception) -> bool:
    """Whether a failed API call is worth trying again: the API server was busy or
    briefly away, or the connection dropped."""
    if isinstance(exc, httpx.HTTPStatusError):
        return status_code(exc) in (429, 500, 502, 503, 504)
    return isinstance(exc, httpx.TransportError)


def status_code(exc: httpx.HTTPStatusError) -> int:
    """The code of an API error: the Status' own (an ERROR event in a watch's 200 stream
    carries one), else the answer's. lightkube raises a refused watch as httpx's
    HTTPStatusError, not as its ApiError: its body is not read."""
    if isinstance(exc, ApiError) and exc.status.code is not None:
        return exc.status.code
    return exc.response.status_code


def refusal(exc: httpx.HTTPError) -> str:
    """An API call's or watch's failure in words: its code, reason and the API's message
    (the client's messages never carry the credentials), or the connection's error."""
    if isinstance(exc, ApiError):
        message = (exc.status.message or "")[:200]
        return f"{status_code(exc)} {exc.status.reason}: {message}".rstrip(": ")
    if isinstance(exc, httpx.HTTPStatusError):
        return f"{exc.response.status_code} {exc.response.reason_phrase}"
    return f"{type(exc).__name__}: {str(exc)[:200]}".rstrip(": ")


def on_watch_error(exc: Exception, count: int) -> OnErrorResult:
    """A watch that failed transiently is made again by lightkube (from the last version
    heard), up to 5 times in a row with backoff; anything else (a 410 among them) ends
    it with the error."""
    if transient(exc) and count <= 5:
        return OnErrorResult(OnErrorAction.RETRY, sleep=min(0.1 * 2**count, 2.0))
    return OnErrorResult(OnErrorAction.RAISE)
