"""The Kubernetes API the client talks to (HTTPS, bearer token): core `v1` pods and
secrets (create, get, list, watch, update, patch, delete, deletecollection), namespaces
(get, list), and the discovery documents. Errors are `Status` objects (kstatus.py)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import json
import logging
from typing import Any

from aiohttp import web

from . import admission, objects
from .access import Access, Dropped, request_info
from .kstatus import ApiError, already_exists, not_found, respond, status_object, success
from .kubelet import Kubelet
from .selectors import field_matcher, label_matcher
from .store import KINDS, READ_ONLY, Store

log = logging.getLogger("k8s_emulator.api")
GIT_VERSION = "v1.37.0"
_PATCH_TYPES = {
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/json-patch+json": "json",
}
ACCESS: web.AppKey[Access] = web.AppKey("access", Access)
STORE: web.AppKey[Store] = web.AppKey("store", Store)
KUBELET: web.AppKey[Kubelet] = web.AppKey("kubelet", Kubelet)


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )


@web.middleware
async def _gate(request: web.Request, handler: Any) -> web.StreamResponse:
    access = request.app[ACCESS]
    info = request_info(request)
    request["info"] = info
    request["extra"] = {}
    try:
        if not access.authenticate(request):
            raise ApiError(401, "Unauthorized")
        try:
            fault = access.fault_for(info)
        except Dropped:
            access.record(info, 0, **request["extra"])
            log.info("%s %s -> connection dropped", request.method, request.path)
            if request.transport is not None:
                request.transport.close()
            return web.Response()  # never sent: the connection is gone
        if fault is not None and not fault[1]:
            raise fault[0]
        access.authorize(info)
        response = await handler(request)
        if fault is not None:  # carried out, and the answer lost
            raise fault[0]
    except ApiError as error:
        access.record(info, error.code, **request["extra"])
        log.info("%s %s -> %s", request.method, request.path, error.code)
        return respond(error)
    except web.HTTPException as http_error:
        if http_error.status == 404:
            error = ApiError(404, "the server could not find the requested resource", details={})
        elif http_error.status == 405:
            error = ApiError(405, "the server does not allow this method on the requested resource")
        else:
            error = ApiError(http_error.status, http_error.reason)
        access.record(info, error.code, **request["extra"])
        return respond(error)
    if not request.get("recorded"):
        access.record(info, response.status, **request["extra"])
    log.info("%s %s -> %s", request.method, request.path, response.status)
    return response


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:
        raise ApiError(400, f"couldn't get version/kind; json parse error: {exc}") from exc


def _resource(request: web.Request) -> str:
    resource = request.match_info["resource"]
    if resource not in KINDS:
        raise ApiError(404, "the server could not find the requested resource", details={})
    if resource in READ_ONLY and request.method not in ("GET", "HEAD"):
        raise ApiError(405, "the server does not allow this method on the requested resource")
    return resource


# --- discovery -------------------------------------------------------------------------


async def version(_request: web.Request) -> web.Response:
    return _json(
        {
            "major": "1",
            "minor": GIT_VERSION.split(".")[1],
            "gitVersion": GIT_VERSION,
            "gitCommit": "emulated",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.25",
            "compiler": "gc",
            "platform": "linux/amd64",
        }
    )


async def api_versions(request: web.Request) -> web.Response:
    host = request.url.host or "127.0.0.1"
    return _json(
        {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{host}:{request.url.port}"}
            ],
        }
    )


async def api_groups(_request: web.Request) -> web.Response:
    return _json({"kind": "APIGroupList", "apiVersion": "v1", "groups": []})


def _api_resource(name: str, kind: str, namespaced: bool, verbs: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "singularName": kind.lower(),
        "namespaced": namespaced,
        "kind": kind,
        "verbs": verbs,
    }


async def api_resources(_request: web.Request) -> web.Response:
    verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
    return _json(
        {
            "kind": "APIResourceList",
            "groupVersion": "v1",
            "resources": [
                _api_resource("namespaces", "Namespace", False, ["get", "list"]),
                _api_resource("pods", "Pod", True, verbs),
                _api_resource("secrets", "Secret", True, verbs),
                _api_resource("events", "Event", True, verbs),
            ],
        }
    )


# --- namespaces ------------------------------------------------------------------------


def _namespace(store: Store, name: str) -> dict[str, Any]:
    return {
        "kind": "Namespace",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": store.namespaces[name],
            "labels": {"kubernetes.io/metadata.name": name, **store.namespace_labels.get(name, {})},
        },
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active"},
    }


async def get_namespace(request: web.Request) -> web.Response:
    store, name = request.app[STORE], request.match_info["name"]
    store.check_namespace(name)
    return _json(_namespace(store, name))


async def list_namespaces(request: web.Request) -> web.Response:
    store = request.app[STORE]
    items = [_namespace(store, n) for n in sorted(store.namespaces)]
    return _json(
        {
            "kind": "NamespaceList",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(store.revision)},
            "items": items,
        }
    )


# --- collections -----------------------------------------------------------------------


async def list_or_watch(request: web.Request) -> web.StreamResponse:
    store, resource = request.app[STORE], _resource(request)
    namespace = request.match_info.get("namespace")
    query = request.query
    request["extra"]["label_selector"] = query.get("labelSelector")
    match_labels = label_matcher(query.get("labelSelector"))
    match_fields = field_matcher(query.get("fieldSelector"))

    def match(obj: dict[str, Any]) -> bool:
        return match_labels(obj) and match_fields(obj)

    if query.get("watch") in ("true", "1"):
        return await _watch(request, resource, namespace, match)
    items = store.list(resource, namespace, match)
    metadata: dict[str, Any] = {"resourceVersion": str(store.revision)}
    limit = int(query.get("limit") or 0)
    start = 0
    if query.get("continue"):
        try:
            start = int(base64.b64decode(query["continue"]).decode())
        except ValueError as exc:
            raise ApiError(400, "continue key is not valid: illegal base64 data") from exc
    if limit > 0:
        if start + limit < len(items):
            metadata["continue"] = base64.b64encode(str(start + limit).encode()).decode()
            metadata["remainingItemCount"] = len(items) - start - limit
        items = items[start : start + limit]
    return _json(
        {"kind": KINDS[resource] + "List", "apiVersion": "v1", "metadata": metadata, "items": items}
    )


async def _watch(
    request: web.Request, resource: str, namespace: str | None, match: Any
) -> web.StreamResponse:
    store, access = request.app[STORE], request.app[ACCESS]
    watcher = store.watch(resource, namespace, match, request.query.get("resourceVersion"))
    access.record(request["info"], 200, **request["extra"])
    request["recorded"] = True
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    await response.prepare(request)
    timeout = float(request.query.get("timeoutSeconds") or 1800)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                event = await asyncio.wait_for(watcher.queue.get(), remaining)
            except TimeoutError:
                break
            if event is None:
                break
            await response.write(json.dumps(event).encode() + b"\n")
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        store.unwatch(watcher)
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response


async def create(request: web.Request) -> web.Response:
    store, resource = request.app[STORE], _resource(request)
    namespace = request.match_info["namespace"]
    body = await _body(request)
    warnings, _ = objects.decode(KINDS[resource], body, request.query.get("fieldValidation"))
    store.check_namespace(namespace)
    if resource == "pods":
        # Mutating admission (Priority) before validation, validating admission
        # (PodSecurity) after it, as the API server runs them.
        admission.admit_priority(body, store.priority_classes)
        obj = objects.new_pod(body, namespace)
        admission.admit_pod_security(obj, store.namespace_labels.get(namespace, {}))
    else:
        obj = objects.new_secret(body, namespace)
    name = obj["metadata"]["name"]
    request["extra"]["name"] = name
    if store.get(resource, namespace, name) is not None:
        raise already_exists(resource, name)
    if request.query.get("dryRun"):
        return _json(obj, 201)
    store.add(resource, obj)
    headers = {"Warning": ", ".join(f'299 - "{w}"' for w in warnings)} if warnings else None
    return _json(obj, 201, headers)


async def delete_collection(request: web.Request) -> web.Response:
    store, resource = request.app[STORE], _resource(request)
    namespace = request.match_info["namespace"]
    match = label_matcher(request.query.get("labelSelector"))
    deleted = []
    for obj in store.list(resource, namespace, match):
        deleted.append(_delete(request, resource, obj, await _delete_options(request, obj)))
    return _json(
        {
            "kind": KINDS[resource] + "List",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(store.revision)},
            "items": deleted,
        }
    )


# --- items -----------------------------------------------------------------------------


def _existing(request: web.Request) -> tuple[str, dict[str, Any]]:
    store, resource = request.app[STORE], _resource(request)
    name = request.match_info["name"]
    obj = store.get(resource, request.match_info["namespace"], name)
    if obj is None:
        raise not_found(resource, name)
    return resource, obj


async def get_item(request: web.Request) -> web.Response:
    _, obj = _existing(request)
    return _json(obj)


async def _delete_options(request: web.Request, obj: dict[str, Any]) -> dict[str, Any]:
    if "options" not in request:
        body = await _body(request) if request.can_read_body else None
        options = body or {}
        objects.decode("DeleteOptions", options, "Strict")
        request["options"] = options
    options = dict(request["options"])
    for key in ("gracePeriodSeconds", "propagationPolicy"):
        if options.get(key) is None and request.query.get(key) is not None:
            options[key] = request.query[key]
    preconditions = options.get("preconditions") or {}
    meta = obj["metadata"]
    for key in ("uid", "resourceVersion"):
        wanted = preconditions.get(key)
        if wanted is not None and wanted != meta.get(key):
            label = "UID" if key == "uid" else "ResourceVersion"
            raise ApiError(
                409,
                f"Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {meta.get(key)}",  # noqa: E501 - the API's own wording
                reason="Conflict",
                details={"name": meta["name"], "kind": _resource(request)},
            )
    return options


def _delete(
    request: web.Request, resource: str, obj: dict[str, Any], options: dict[str, Any]
) -> dict[str, Any]:
    store, meta = request.app[STORE], obj["metadata"]
    if options.get("propagationPolicy") not in (None, "Background", "Foreground", "Orphan"):
        raise ApiError(400, f'unsupported propagationPolicy: "{options["propagationPolicy"]}"')
    if options.get("propagationPolicy") == "Orphan" or options.get("orphanDependents"):
        for other in store.list("pods", meta["namespace"]) + store.list(
            "secrets", meta["namespace"]
        ):
            owners = other["metadata"].get("ownerReferences") or []
            if any(o.get("uid") == meta["uid"] for o in owners):
                other["metadata"]["ownerReferences"] = [
                    o for o in owners if o.get("uid") != meta["uid"]
                ]
                store.update("pods" if other["kind"] == "Pod" else "secrets", other)
    if resource != "pods":
        store.remove(resource, meta["namespace"], meta["name"])
        return success(resource, meta["name"], meta["uid"])
    grace = options.get("gracePeriodSeconds")
    if grace is None:
        grace = obj["spec"].get("terminationGracePeriodSeconds", 30)
    try:
        grace = max(0, int(grace))
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"invalid gracePeriodSeconds: {grace}") from exc
    request["extra"]["grace_period"] = grace
    return copy.deepcopy(request.app[KUBELET].delete(obj, grace))


async def delete_item(request: web.Request) -> web.Response:
    resource, obj = _existing(request)
    options = await _delete_options(request, obj)
    return _json(_delete(request, resource, obj, options))


async def update_item(request: web.Request) -> web.Response:
    store = request.app[STORE]
    resource, obj = _existing(request)
    body = await _body(request)
    objects.decode(KINDS[resource], body, request.query.get("fieldValidation"))
    given = (body.get("metadata") or {}).get("resourceVersion")
    if given and given != obj["metadata"]["resourceVersion"]:
        raise _conflict(resource, obj)
    return _json(_apply(store, resource, obj, body))


async def patch_item(request: web.Request) -> web.Response:
    store = request.app[STORE]
    resource, obj = _existing(request)
    kind = _PATCH_TYPES.get(request.content_type)
    if kind is None:
        raise ApiError(
            415,
            f"the body of the request was in an unknown format - accepted media types include: {', '.join(_PATCH_TYPES)}",  # noqa: E501 - the API's own wording
        )
    patch = await _body(request)
    if kind == "json":
        new = objects.json_patch(obj, patch)
    else:
        if not isinstance(patch, dict):
            raise ApiError(400, "the body of the request must be a JSON object")
        new = objects.merge_patch(obj, patch, strategic=kind == "strategic")
    objects.decode(KINDS[resource], new, request.query.get("fieldValidation"))
    given = (new.get("metadata") or {}).get("resourceVersion")
    if given and given != obj["metadata"]["resourceVersion"]:
        raise _conflict(resource, obj)
    return _json(_apply(store, resource, obj, new))


def _conflict(resource: str, obj: dict[str, Any]) -> ApiError:
    name = obj["metadata"]["name"]
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; please apply your changes to the latest version and try again',  # noqa: E501 - the API's own wording
        reason="Conflict",
        details={"name": name, "kind": resource},
    )


def _apply(store: Store, resource: str, old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    result = objects.updated(resource, old, new)
    if result == old:
        return old  # a no-op update keeps its resourceVersion
    return store.update(resource, result)


# --- the app ---------------------------------------------------------------------------


def make_api_app(store: Store, kubelet: Kubelet, access: Access) -> web.Application:
    app = web.Application(middlewares=[_gate], client_max_size=8 * 1024 * 1024)
    app[STORE], app[KUBELET], app[ACCESS] = store, kubelet, access
    collection = "/api/v1/namespaces/{namespace}/{resource}"
    item = collection + "/{name}"
    app.router.add_get("/version", version)
    app.router.add_get("/api", api_versions)
    app.router.add_get("/apis", api_groups)
    app.router.add_get("/api/v1", api_resources)
    app.router.add_get("/api/v1/namespaces", list_namespaces)
    app.router.add_get("/api/v1/namespaces/{name}", get_namespace)
    app.router.add_get("/api/v1/{resource}", list_or_watch)
    app.router.add_get(collection, list_or_watch)
    app.router.add_post(collection, create)
    app.router.add_delete(collection, delete_collection)
    app.router.add_get(item, get_item)
    app.router.add_put(item, update_item)
    app.router.add_patch(item, patch_item)
    app.router.add_delete(item, delete_item)
    return app


__all__ = ["make_api_app", "status_object"]
