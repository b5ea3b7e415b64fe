"""The API server's objects: namespaces, pods and secrets, their resource versions, the
watch event log, and garbage collection by owner reference.

All in one asyncio loop: handlers, the kubelet and the control API change objects only
through `Store`, which bumps `metadata.resourceVersion` (one counter for everything, as
etcd's revision), tells watchers, and calls `on_change` (the kubelet's wake-up).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .kstatus import ApiError, status_object
from .selectors import Matcher

DEFAULT_NAMESPACES = ("default", "openalice")
KINDS = {"pods": "Pod", "secrets": "Secret", "events": "Event"}
# Kinds the API only reads: events are written by the emulator's own controllers
# (autoscaler.py), never by the client.
READ_ONLY = frozenset({"events"})
_EVENT_LOG = 5000


def rfc3339(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(int(seconds), datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass(eq=False)
class Watcher:
    resource: str
    namespace: str | None
    match: Matcher
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)


class Store:
    def __init__(self, namespaces: list[str] | None = None) -> None:
        self.clock_offset = 0.0
        self.on_change: Callable[[], None] = lambda: None
        self.start_namespaces = [*DEFAULT_NAMESPACES, *(namespaces or [])]
        self.reset()

    def reset(self) -> None:
        """Back to the start: its namespaces only, no objects, no watchers, no clock move."""
        self.namespaces: dict[str, str] = {}
        # Labels a test gave a namespace (Pod Security's), and the PriorityClasses made
        # besides the system ones (admission.py).
        self.namespace_labels: dict[str, dict[str, str]] = {}
        self.priority_classes: dict[str, int] = {}
        for name in self.start_namespaces:
            self.add_namespace(name)
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.revision = getattr(self, "revision", 0)
        # Every resourceVersion below this one is too old to watch from
        # (`expire_watches`); kept across resets, as the revision is.
        self.compacted = getattr(self, "compacted", 0)
        self.events: deque[tuple[int, str, str, dict[str, Any]]] = deque(maxlen=_EVENT_LOG)
        self.clock_offset = 0.0
        for watcher in getattr(self, "watchers", set()):
            watcher.queue.put_nowait(None)
        self.watchers: set[Watcher] = set()

    # --- time and versions -------------------------------------------------------------

    def now(self) -> float:
        """The emulator's clock: wall time plus what `advance_clock` added."""
        return time.time() + self.clock_offset

    def timestamp(self) -> str:
        return rfc3339(self.now())

    def _next_version(self) -> str:
        self.revision += 1
        return str(self.revision)

    @property
    def oldest_version(self) -> int:
        return self.events[0][0] if self.events else self.revision

    # --- namespaces --------------------------------------------------------------------

    def add_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        self.namespaces.setdefault(name, str(uuid.uuid4()))
        if labels:
            self.namespace_labels.setdefault(name, {}).update(labels)

    def check_namespace(self, namespace: str) -> None:
        if namespace not in self.namespaces:
            raise ApiError(
                404,
                f'namespaces "{namespace}" not found',
                details={"name": namespace, "kind": "namespaces"},
            )

    # --- objects -----------------------------------------------------------------------

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((resource, namespace, name))

    def list(
        self, resource: str, namespace: str | None, match: Matcher | None = None
    ) -> list[dict[str, Any]]:
        found = [
            obj
            for (res, ns, _), obj in self.objects.items()
            if res == resource and (namespace is None or ns == namespace)
        ]
        found = [o for o in found if match is None or match(o)]
        return sorted(found, key=lambda o: (o["metadata"]["namespace"], o["metadata"]["name"]))

    def add(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        key = (resource, meta["namespace"], meta["name"])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = self.timestamp()
        meta["resourceVersion"] = self._next_version()
        self.objects[key] = obj
        self._publish(resource, "ADDED", obj)
        return obj

    def update(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        meta["resourceVersion"] = self._next_version()
        self.objects[(resource, meta["namespace"], meta["name"])] = obj
        self._publish(resource, "MODIFIED", obj)
        return obj

    def remove(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        """Remove the object, then (background propagation) every object it owns."""
        obj = self.objects.pop((resource, namespace, name), None)
        if obj is None:
            return None
        obj["metadata"]["resourceVersion"] = self._next_version()
        self._publish(resource, "DELETED", obj)
        uid = obj["metadata"]["uid"]
        for (res, ns, child), other in list(self.objects.items()):
            owners = other["metadata"].get("ownerReferences") or []
            if ns == namespace and any(o.get("uid") == uid for o in owners):
                self.remove(res, ns, child)
        return obj

    # --- watches -----------------------------------------------------------------------

    def _publish(self, resource: str, kind: str, obj: dict[str, Any]) -> None:
        snapshot = copy.deepcopy(obj)
        version = int(snapshot["metadata"]["resourceVersion"])
        self.events.append((version, resource, kind, snapshot))
        for watcher in list(self.watchers):
            if watcher.resource == resource and self._concerns(watcher, snapshot):
                watcher.queue.put_nowait({"type": kind, "object": snapshot})
        self.on_change()

    @staticmethod
    def _concerns(watcher: Watcher, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        if watcher.namespace is not None and meta["namespace"] != watcher.namespace:
            return False
        return watcher.match(obj)

    def watch(
        self, resource: str, namespace: str | None, match: Matcher, since: str | None
    ) -> Watcher:
        """A watcher, its queue primed as the API does: from `since` (a resourceVersion)
        the events after it; without one (or "0"), ADDED for each object that matches now.

        A `since` too old (older than the event log kept, or below what
        `expire_watches` made too old) is not an HTTP error: the stream answers 200 with
        one ERROR event carrying a Status 410 Expired, then ends. The API server's watch
        cache does so "to match the uncached watch implementation"
        (k8s.io/apiserver pkg/storage/cacher/cacher.go, Watch: `newErrWatcher`), and
        clients must then list again
        (https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes)."""
        watcher = Watcher(resource, namespace, match)
        if since in (None, "", "0"):
            for obj in self.list(resource, namespace, match):
                watcher.queue.put_nowait({"type": "ADDED", "object": copy.deepcopy(obj)})
        else:
            try:
                version = int(str(since))
            except ValueError as exc:
                raise ApiError(400, f'invalid resource version: "{since}"') from exc
            oldest = max(self.compacted, self.oldest_version - 1 if self.events else 0)
            if version < self.compacted or (self.events and version < self.oldest_version - 1):
                # The watch cache's words (cacher/watch_cache.go): "too old resource
                # version: %d (%d)", the second the oldest version it still has, less one.
                expired(watcher, f"too old resource version: {version} ({oldest})")
                return watcher
            for event_version, res, kind, obj in self.events:
                if event_version > version and res == resource and self._concerns(watcher, obj):
                    watcher.queue.put_nowait({"type": kind, "object": copy.deepcopy(obj)})
        self.watchers.add(watcher)
        return watcher

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)

    def end_watches(self) -> int:
        """End every open watch stream cleanly, as the API server does when a watch's
        timeout is reached: the client watches again from the last resourceVersion it saw
        (https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes).
        How many there were."""
        ended = len(self.watchers)
        for watcher in self.watchers:
            watcher.queue.put_nowait(None)
        self.watchers = set()
        return ended

    def expire_watches(self) -> int:
        """Make every resourceVersion handed out so far too old, as etcd's compaction
        does: each open watch gets one ERROR event (Status 410 Expired, "The
        resourceVersion for the provided watch is too old.", the words of
        k8s.io/apiserver pkg/storage/etcd3/errors.go for a compacted watch) and ends; a
        watch from any of those versions then gets the same in its 200 stream
        (https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes).
        How many open watches were expired."""
        # The API server's compactor writes its own key before it compacts: the revision
        # moves on, and a list from now hands out a version that can be watched from.
        self.revision += 1
        self.compacted = self.revision
        expired_now = len(self.watchers)
        for watcher in self.watchers:
            expired(watcher, "The resourceVersion for the provided watch is too old.")
        self.watchers = set()
        return expired_now


def expired(watcher: Watcher, message: str) -> None:
    """Queue the ERROR event of a watch whose resourceVersion is too old, then its end."""
    status = status_object(410, message, "Expired")
    watcher.queue.put_nowait({"type": "ERROR", "object": status})
    watcher.queue.put_nowait(None)
