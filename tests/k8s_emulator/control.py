"""Test-only control API on loopback (plain HTTP, JSON): the tests' hands, not the
client's traffic. It needs no credentials and is not in the audit list.

- `GET  /_emulator/healthz`
- `GET  /_emulator/state`: nodes, switches, clock offset, namespaces.
- `GET  /_emulator/objects/{pods|secrets|events}[?namespace=]`: full objects (also terminating).
- `GET  /_emulator/requests`: the audit list (verb, resource, namespace, name, code,
  grace_period for pod deletes, label_selector for lists).
- `GET  /_emulator/containers`: the Docker containers made, with their pods.
- `POST /_emulator/clock {"advance": s}`: move the clock; answers once the kubelet has
  acted: the pods whose deadline passed are Failed and their containers stopped and
  removed, `{"now", "ended": [namespace/name of those pods]}`.
- `POST /_emulator/pods/{namespace}/{name}/oom-kill`: the kernel's OOM killer ends the
  pod's container; answers with the pod once it shows it (404 no pod, 409 not running).
- `POST /_emulator/pods/{namespace}/{name}/evict {"resource": "memory"}`: the kubelet
  evicts the pod for node pressure; answers with the pod once it is Failed (or
  Succeeded, see README).
- `POST /_emulator/nodes/{name}/lose`: the node is gone; answers once the PodGC
  controller has deleted its pods, `{"collected": [namespace/name]}`.
- `POST /_emulator/watches/end`: every open watch ends cleanly, `{"ended": n}`.
- `POST /_emulator/watches/expire`: every resourceVersion handed out so far is too old;
  open watches get an ERROR 410 event and end, `{"expired": n, "compacted": revision}`.
- `POST /_emulator/node-groups {"groups": [{"name", "template": {"labels",
  "allocatable"}, "maxSize", "delaySeconds"}]}`: the cluster autoscaler's node groups
  (autoscaler.py; none: no autoscaler).
- `POST /_emulator/flaky-pulls {"images": {image: n}}`: each pod's first n pulls of the
  image fail (ErrImagePull, ImagePullBackOff), the next one succeeds (pulls.py).
- `POST /_emulator/nodes {"nodes": [...]}`, `/_emulator/unpullable {"images": [...]}`,
  `/_emulator/kubelet {"paused": bool}`, `/_emulator/rbac {"rules": [...] | null}`,
  `/_emulator/namespaces {"name": ..., "labels": {...}}`, `/_emulator/priorityclasses
  {"name": ..., "value": n}`, `/_emulator/faults {"n", "code", "verb", "after",
  "resource", "retry_after", "message"}` (or `{"drop": true, "n", "verb", "resource"}`: the
  connection closed without an answer; or `{"clear": true}`), `/_emulator/sync`
  (one whole kubelet pass), `/_emulator/reset`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from tests.emulator_common import control_app, read_json

from .access import Access, Fault
from .autoscaler import validate_groups
from .kubelet import Kubelet, NotRunning
from .scheduling import validate_nodes
from .store import Store

_FAULT_CODES = (400, 403, 404, 409, 429, 500, 503)


def make_control_app(store: Store, kubelet: Kubelet, access: Access) -> web.Application:
    routes = web.RouteTableDef()

    async def body(request: web.Request) -> dict[str, Any]:
        data = await read_json(request) if request.can_read_body else {}
        if not isinstance(data, dict):
            raise web.HTTPBadRequest(text="a JSON object is expected")
        return data

    @routes.get("/_emulator/state")
    async def state(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "nodes": kubelet.nodes,
                "paused": kubelet.paused,
                "unpullable": sorted(kubelet.unpullable),
                "flaky_pulls": kubelet.flaky_pulls,
                "node_groups": [
                    {"name": g.name, "size": g.size, "max_size": g.max_size}
                    for g in kubelet.autoscaler.groups
                ],
                "rbac": access.rules,
                "faults": [vars(f) for f in access.faults],
                "clock_offset": store.clock_offset,
                "now": store.now(),
                "namespaces": sorted(store.namespaces),
                "revision": store.revision,
                "compacted": store.compacted,
                "watches": len(store.watchers),
            }
        )

    @routes.get("/_emulator/objects/{resource}")
    async def objects(request: web.Request) -> web.Response:
        resource = request.match_info["resource"]
        if resource not in ("pods", "secrets", "events"):
            raise web.HTTPNotFound()
        return web.json_response(store.list(resource, request.query.get("namespace")))

    @routes.get("/_emulator/requests")
    async def requests(_request: web.Request) -> web.Response:
        return web.json_response(access.audit)

    @routes.get("/_emulator/containers")
    async def containers(_request: web.Request) -> web.Response:
        return web.json_response(await asyncio.to_thread(kubelet.runtime.containers))

    @routes.post("/_emulator/clock")
    async def clock(request: web.Request) -> web.Response:
        advance = (await body(request)).get("advance")
        if not isinstance(advance, (int, float)) or advance < 0:
            raise web.HTTPBadRequest(text="advance: a number of seconds >= 0")
        before = set(kubelet.deadline_kills)
        store.clock_offset += float(advance)
        await kubelet.settle()  # a whole pass after the move: every deadline passed is seen
        new = {uid: entry for uid, entry in kubelet.deadline_kills.items() if uid not in before}
        # ... and each of those pods is Failed, its container stopped and removed.
        await asyncio.gather(*(task for _, task in new.values()), return_exceptions=True)
        return web.json_response({"now": store.now(), "ended": sorted(k for k, _ in new.values())})

    @routes.post("/_emulator/pods/{namespace}/{name}/oom-kill")
    async def oom_kill(request: web.Request) -> web.Response:
        info = request.match_info
        try:
            pod = await kubelet.oom_kill(info["namespace"], info["name"])
        except NotRunning as exc:
            raise _refused(exc) from exc
        return web.json_response(pod)

    @routes.post("/_emulator/pods/{namespace}/{name}/evict")
    async def evict(request: web.Request) -> web.Response:
        info = request.match_info
        resource = str((await body(request)).get("resource") or "memory")
        try:
            pod = await kubelet.evict(info["namespace"], info["name"], resource)
        except NotRunning as exc:
            raise _refused(exc) from exc
        return web.json_response(pod)

    @routes.post("/_emulator/nodes/{name}/lose")
    async def lose_node(request: web.Request) -> web.Response:
        try:
            collected = await kubelet.lose_node(request.match_info["name"])
        except NotRunning as exc:
            raise _refused(exc) from exc
        return web.json_response({"collected": collected})

    @routes.post("/_emulator/watches/end")
    async def end_watches(_request: web.Request) -> web.Response:
        return web.json_response({"ended": store.end_watches()})

    @routes.post("/_emulator/watches/expire")
    async def expire_watches(_request: web.Request) -> web.Response:
        expired = store.expire_watches()
        return web.json_response({"expired": expired, "compacted": store.compacted})

    @routes.post("/_emulator/nodes")
    async def nodes(request: web.Request) -> web.Response:
        try:
            kubelet.nodes = validate_nodes(list((await body(request)).get("nodes") or []))
        except (ValueError, TypeError) as exc:
            raise web.HTTPBadRequest(text=str(exc)) from exc
        await kubelet.settle()
        return web.json_response(kubelet.nodes)

    @routes.post("/_emulator/unpullable")
    async def unpullable(request: web.Request) -> web.Response:
        kubelet.unpullable = {str(i) for i in (await body(request)).get("images") or []}
        kubelet.wake()
        return web.json_response(sorted(kubelet.unpullable))

    @routes.post("/_emulator/node-groups")
    async def node_groups(request: web.Request) -> web.Response:
        try:
            kubelet.autoscaler.groups = validate_groups(
                list((await body(request)).get("groups") or [])
            )
        except (ValueError, TypeError) as exc:
            raise web.HTTPBadRequest(text=str(exc)) from exc
        await kubelet.settle()
        return web.json_response([g.name for g in kubelet.autoscaler.groups])

    @routes.post("/_emulator/flaky-pulls")
    async def flaky_pulls(request: web.Request) -> web.Response:
        images = (await body(request)).get("images") or {}
        if not isinstance(images, dict) or not all(
            isinstance(n, int) and n >= 0 for n in images.values()
        ):
            raise web.HTTPBadRequest(text="images: {image: failures before a pull succeeds}")
        kubelet.flaky_pulls = {str(k): int(v) for k, v in images.items()}
        kubelet.wake()
        return web.json_response(kubelet.flaky_pulls)

    @routes.post("/_emulator/kubelet")
    async def pause(request: web.Request) -> web.Response:
        kubelet.paused = bool((await body(request)).get("paused"))
        await kubelet.settle()
        return web.json_response({"paused": kubelet.paused})

    @routes.post("/_emulator/rbac")
    async def rbac(request: web.Request) -> web.Response:
        rules = (await body(request)).get("rules")
        if rules is not None and not (
            isinstance(rules, list) and all(isinstance(r, dict) for r in rules)
        ):
            raise web.HTTPBadRequest(text="rules: a list of {apiGroups, resources, verbs} or null")
        access.rules = rules
        return web.json_response({"rules": rules})

    @routes.post("/_emulator/namespaces")
    async def namespaces(request: web.Request) -> web.Response:
        data = await body(request)
        name = str(data.get("name") or "")
        labels = data.get("labels") or {}
        if not name or not isinstance(labels, dict):
            raise web.HTTPBadRequest(text="name is required; labels: an object")
        store.add_namespace(name, {str(k): str(v) for k, v in labels.items()})
        return web.json_response(sorted(store.namespaces))

    @routes.post("/_emulator/priorityclasses")
    async def priority_classes(request: web.Request) -> web.Response:
        data = await body(request)
        name, value = data.get("name"), data.get("value")
        if not isinstance(name, str) or not name or not isinstance(value, int):
            raise web.HTTPBadRequest(text="name: a string, value: an integer")
        store.priority_classes[name] = value
        return web.json_response(store.priority_classes)

    @routes.post("/_emulator/faults")
    async def faults(request: web.Request) -> web.Response:
        data = await body(request)
        if data.get("clear"):
            access.faults = []
            return web.json_response([])
        drop = bool(data.get("drop", False))
        code = 0 if drop else data.get("code")
        n = data.get("n", 1)
        if (not drop and code not in _FAULT_CODES) or not isinstance(n, int) or n < 1:
            raise web.HTTPBadRequest(text=f"code one of {_FAULT_CODES} (or drop), n >= 1")
        access.faults.append(
            Fault(
                remaining=n,
                code=code,
                verb=data.get("verb"),
                resource=data.get("resource"),
                retry_after=int(data.get("retry_after", 1)),
                message=data.get("message"),
                after=bool(data.get("after", False)),
                drop=drop,
            )
        )
        return web.json_response([vars(f) for f in access.faults])

    @routes.post("/_emulator/sync")
    async def sync(_request: web.Request) -> web.Response:
        await kubelet.settle()
        return web.json_response({"ok": True})

    @routes.post("/_emulator/reset")
    async def reset(_request: web.Request) -> web.Response:
        await kubelet.reset()  # its containers, then the store
        access.rules = None
        access.faults = []
        access.audit.clear()
        return web.json_response({"ok": True})

    return control_app(routes)


def _refused(error: NotRunning) -> web.HTTPException:
    kinds: dict[int, type[web.HTTPException]] = {
        400: web.HTTPBadRequest,
        404: web.HTTPNotFound,
        409: web.HTTPConflict,
    }
    return kinds.get(error.code, web.HTTPConflict)(text=str(error))
