"""REST v2: the pod operations and the GPU catalog the driver uses.

Bodies are validated against RunPod's OpenAPI file (422 with `errors`), then against the
cross-field rules RunPod enforces in its handlers (400), then placed (400 on no capacity).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .catalog import AVAILABILITY_LEVELS, CLOUDS, CUDA_VERSIONS, GPU_TYPES, GpuType
from .pipeline import (
    Context,
    body_for_log,
    context,
    is_authorized,
    problem,
    read_json,
    retry_after,
    run_guarded,
)
from .state import NO_CAPACITY_MESSAGE, EmulatorState, Fault, PlacementError, Pod, PodSpec
from .views import iso_time, parse_port, port_mappings

RestHandler = Callable[[Context, Request, int], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]

_FAULT_DETAILS: dict[int, str] = {
    400: NO_CAPACITY_MESSAGE,
    401: "invalid bearer token",
    402: "insufficient balance: add funds to deploy this pod",
    403: "access denied",
    404: "resource not found",
    429: "rate limit exceeded for the minute window",
}
_ACTIONS: dict[str, list[str]] = {
    "PROVISIONING": ["stop", "terminate"],
    "STARTING": ["stop", "restart", "terminate"],
    "RUNNING": ["stop", "restart", "terminate"],
    "EXITED": ["start", "terminate"],
    "ERROR": ["restart", "terminate"],
    "TERMINATED": [],
}
_PRODUCTS = ("POD", "CLUSTER", "SERVERLESS")


def rest_operation(op: str) -> Callable[[RestHandler], Endpoint]:
    """Wrap a handler with call recording, bearer auth, slowness and queued faults."""

    def decorate(handler: RestHandler) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            ctx = context(request)
            body = await body_for_log(request)
            seq = ctx.state.begin_call("rest", request.method, request.url.path, op, body)
            if is_authorized(request, ctx.api_key):
                response = await run_guarded(
                    ctx, op, lambda: handler(ctx, request, seq), render_fault
                )
            else:
                response = problem(401, "missing or invalid bearer token")
            ctx.state.annotate_call(seq, status=response.status_code)
            return response

        endpoint.__name__ = handler.__name__
        return endpoint

    return decorate


def render_fault(fault: Fault) -> Response:
    default = _FAULT_DETAILS.get(fault.status, "upstream service error, please retry")
    return problem(fault.status, fault.detail or default, headers=retry_after(fault))


# ---------------------------------------------------------------------- pods


@rest_operation("createPod")
async def create_pod(ctx: Context, request: Request, seq: int) -> Response:
    body, not_json = await read_json(request)
    if not_json:
        return problem(400, not_json)
    errors = ctx.schemas.errors("CreatePodRequest", body)
    if errors:
        return problem(422, "Request validation failed.", errors=errors)
    violation = _rule_violation(body)
    if violation:
        return problem(400, violation)
    if _cuda_unavailable(body.get("gpu") or {}):
        return problem(400, NO_CAPACITY_MESSAGE)
    try:
        pod = ctx.state.create_pod(_spec(body))
    except PlacementError as refused:
        return problem(400, refused.detail)
    ctx.state.annotate_call(seq, pod_id=pod.id)
    return JSONResponse(render_pod(pod), status_code=201)


@rest_operation("getPod")
async def get_pod(ctx: Context, request: Request, seq: int) -> Response:
    pod_id = request.path_params["id"]
    ctx.state.annotate_call(seq, pod_id=pod_id)
    pod = ctx.state.get_pod(pod_id)
    if pod is None:
        return problem(404, "pod not found")
    return JSONResponse(render_pod(pod))


@rest_operation("listPods")
async def list_pods(ctx: Context, request: Request, seq: int) -> Response:
    return JSONResponse({"pods": [render_pod(pod) for pod in ctx.state.list_pods()]})


@rest_operation("deletePod")
async def delete_pod(ctx: Context, request: Request, seq: int) -> Response:
    pod_id = request.path_params["id"]
    ctx.state.annotate_call(seq, pod_id=pod_id)
    if not ctx.state.terminate_pod(pod_id):
        return problem(404, "pod not found")
    return Response(status_code=204)


def _rule_violation(body: dict[str, Any]) -> str | None:
    """Rules the OpenAPI file leaves to RunPod's handler layer (400, not 422)."""
    mounts = body.get("mounts") or {}
    gpu = body.get("gpu") or {}
    if ("gpu" in body) == ("cpu" in body):
        return "exactly one of gpu or cpu must be set"
    if "persistent" in mounts and "network" in mounts:
        return "mounts.persistent and mounts.network are mutually exclusive"
    if "cpu" in body and "persistent" in mounts:
        return "mounts.persistent is not supported on CPU pods"
    if gpu.get("allowedCudaVersions") and "minCudaVersion" in gpu:
        return "gpu.allowedCudaVersions and gpu.minCudaVersion are mutually exclusive"
    bad_ports = [port for port in body.get("ports", []) if parse_port(port) is None]
    if bad_ports:
        return f"ports must be <port>/http or <port>/tcp, got {', '.join(bad_ports)}"
    return None


def _cuda_unavailable(gpu: dict[str, Any]) -> bool:
    """A CUDA constraint no host meets is a capacity error, not a fallback (per the spec)."""
    allowed = gpu.get("allowedCudaVersions") or []
    if allowed and not set(allowed) & set(CUDA_VERSIONS):
        return True
    floor = gpu.get("minCudaVersion")
    return floor is not None and not any(
        _version(offered) >= _version(floor) for offered in CUDA_VERSIONS
    )


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _spec(body: dict[str, Any]) -> PodSpec:
    gpu, cpu = body.get("gpu"), body.get("cpu")
    # Templates are not modelled: a template pod just gets a recognisable placeholder image.
    image = body.get("image") or f"runpod-template/{body.get('templateId')}"
    return PodSpec(
        name=body["name"],
        image=image,
        gpu_id=gpu["id"] if gpu else None,
        gpu_count=gpu.get("count", 1) if gpu else 1,
        cpu_id=cpu["id"] if cpu else None,
        vcpu_count=cpu["vcpuCount"] if cpu else 0,
        cloud=body.get("cloud", "SECURE"),
        data_center_ids=tuple(body.get("dataCenterIds", [])),
        args=body.get("args", ""),
        disk=body.get("disk", 50),
        ports=tuple(body.get("ports", [])),
        env=tuple((body.get("env") or {}).items()),
        mounts=body.get("mounts") or {},
    )


def render_pod(pod: Pod) -> dict[str, Any]:
    """A `Pod` as the OpenAPI file describes it; `runtime` is null until RUNNING."""
    body: dict[str, Any] = {
        "id": pod.id,
        "name": pod.name,
        "status": pod.status,
        "actions": _ACTIONS[pod.status],
        "image": pod.image,
        "args": pod.args,
        "disk": pod.disk,
        "mounts": pod.mounts,
        "ports": list(pod.ports),
        "env": pod.env,
        "registry": None,
        "cloud": pod.cloud,
        "dataCenterId": pod.data_center_id,
        "cudaVersion": CUDA_VERSIONS[0] if pod.gpu_id else None,
        "ssh": _ssh(pod),
        "template": None,
        "cost": 0.0 if pod.status in ("EXITED", "TERMINATED") else pod.cost_per_hr,
        "locked": False,
        "globalNetworking": {"enabled": False},
        "runtime": _runtime(pod) if pod.status == "RUNNING" else None,
        "createdAt": iso_time(pod.created_at),
        "startedAt": iso_time(pod.started_at),
    }
    if pod.gpu_id:
        body["gpu"] = {"id": pod.gpu_id, "count": pod.gpu_count}
    else:
        body["cpu"] = {"id": pod.cpu_id, "vcpuCount": pod.vcpu_count, "memory": pod.memory_gb}
    return body


def _runtime(pod: Pod) -> dict[str, Any]:
    return {
        "uptime": pod.uptime,
        "gpus": [{"util": 0, "memoryUtil": 0} for _ in range(pod.gpu_count)],
        "cpu": {"util": 0},
        "memory": {"util": 0},
        "ports": [
            {"private": m.private, "public": m.public, "type": m.type, "ip": m.ip}
            for m in port_mappings(pod)
        ],
    }


def _ssh(pod: Pod) -> dict[str, Any]:
    user = f"{pod.id}-{pod.machine_id[:8]}"
    proxy = {
        "host": "ssh.runpod.io",
        "port": 22,
        "username": user,
        "command": f"ssh {user}@ssh.runpod.io",
    }
    direct = None
    if pod.status == "RUNNING":
        for m in port_mappings(pod):
            if m.private == 22 and m.type == "tcp":
                direct = {
                    "host": m.ip,
                    "port": m.public,
                    "username": "root",
                    "command": f"ssh root@{m.ip} -p {m.public}",
                }
    return {"proxy": proxy, "direct": direct}


# ---------------------------------------------------------------------- catalog


@dataclass(frozen=True)
class CatalogQuery:
    availability: bool
    cloud: str
    count: int


@rest_operation("listGpuTypes")
async def list_gpu_types(ctx: Context, request: Request, seq: int) -> Response:
    query = _catalog_query(request.query_params)
    if isinstance(query, Response):
        return query
    return JSONResponse({"gpus": [render_gpu_type(ctx.state, gpu, query) for gpu in GPU_TYPES]})


def _catalog_query(params: QueryParams) -> CatalogQuery | Response:
    """Parameter rules of listGpuTypes: bad values 422, misplaced ones 400."""
    include = _csv(params.get("include"))
    products = _csv(params.get("product"))
    cloud, count = params.get("cloud"), params.get("count")
    errors = [
        f"$.include: {v!r} is not one of ['AVAILABILITY']" for v in include if v != "AVAILABILITY"
    ]
    errors += [
        f"$.product: {v!r} is not one of {list(_PRODUCTS)}" for v in products if v not in _PRODUCTS
    ]
    if cloud is not None and cloud not in CLOUDS:
        errors.append(f"$.cloud: {cloud!r} is not one of {list(CLOUDS)}")
    if count is not None and (not count.isdigit() or int(count) < 1):
        errors.append(f"$.count: {count!r} is not an integer >= 1")
    if errors:
        return problem(422, "Request validation failed.", errors=errors)
    if include and not products:
        return problem(400, "product is required with include=AVAILABILITY")
    if not include and (products or cloud or count):
        return problem(400, "product, cloud and count are valid only with include=AVAILABILITY")
    return CatalogQuery(bool(include), cloud or "SECURE", int(count or 1))


def _csv(value: str | None) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()] if value else []


def render_gpu_type(state: EmulatorState, gpu: GpuType, query: CatalogQuery) -> dict[str, Any]:
    secure, community = state.price(gpu.id)
    body: dict[str, Any] = {
        "id": gpu.id,
        "name": gpu.name,
        "pool": gpu.pool,
        "manufacturer": "NVIDIA",
        "memory": gpu.memory_gb,
        "secure": True,
        "community": True,
        "price": {"secure": secure, "community": community},
        "maxCount": {"secure": gpu.max_count_secure, "community": gpu.max_count_community},
    }
    if not query.availability:
        return body
    per_dc = [
        {
            "id": dc,
            "name": name,
            "availability": state.availability(gpu.id, dc, count=query.count, cloud=query.cloud),
        }
        for dc, name in state.data_centers().items()
    ]
    overall = max(
        (d["availability"] for d in per_dc), key=AVAILABILITY_LEVELS.index, default="NONE"
    )
    body["availability"] = overall
    # RunPod omits `dataCenters` entirely when the configuration is unavailable everywhere.
    if overall != "NONE":
        body["dataCenters"] = per_dc
    body["cudaVersions"] = [
        {"version": version, "available": overall != "NONE"} for version in CUDA_VERSIONS
    ]
    return body


ROUTES: list[Route] = [
    Route("/v2/pods", create_pod, methods=["POST"]),
    Route("/v2/pods", list_pods, methods=["GET"]),
    Route("/v2/pods/{id}", get_pod, methods=["GET"]),
    Route("/v2/pods/{id}", delete_pod, methods=["DELETE"]),
    Route("/v2/catalog/gpus", list_gpu_types, methods=["GET"]),
]
