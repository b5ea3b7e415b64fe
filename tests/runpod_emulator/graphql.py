"""RunPod's GraphQL API (`POST /graphql`), for the operations the original driver used.

Errors follow RunPod's split: a request that cannot be run at all (bad JSON, syntax, unknown
field, bad variables) is HTTP 400; a bad key is HTTP 401; anything that goes wrong while
running the operation is HTTP 200 with `errors` and the field set to null.

Inputs are read from `variables` only. An inline literal argument is refused with a 400 that
says why: the driver must never interpolate data into query text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .catalog import GPU_TYPES_BY_ID
from .graphql_parser import Field, GraphQLSyntaxError, Literal, Operation, Variable, parse_document
from .pipeline import Context, context, is_authorized, read_json, retry_after, run_guarded
from .state import NO_CAPACITY_MESSAGE, NO_CAPACITY_WORDS, Fault, PlacementError, Pod, PodSpec
from .views import iso_time, parse_port, port_mappings

GENERIC_ERROR_MESSAGE = "Something went wrong. Please try again later or contact support."
NOT_FOUND_TO_TERMINATE = "pod not found to terminate"


@dataclass(frozen=True)
class RootField:
    operation_kind: str  # "query" | "mutation"
    result_type: str | None  # object type, or None for a scalar result
    input_type: str | None  # type of the `input` argument, if the field takes one


ROOT_FIELDS: dict[str, RootField] = {
    "podFindAndDeployOnDemand": RootField("mutation", "Pod", "PodFindAndDeployOnDemandInput"),
    "podTerminate": RootField("mutation", None, "PodTerminateInput"),
    "pod": RootField("query", "Pod", "PodFilter"),
    "myself": RootField("query", "User", None),
}

# Output types: field -> object type it returns (None = scalar or list of scalars). Asking for
# a field not listed is a 400, as on a real GraphQL server, so a typo fails in tests.
_POD_SCALARS = [
    "id", "name", "imageName", "desiredStatus", "lastStatusChange", "machineId", "podType",
    "costPerHr", "adjustedCostPerHr", "gpuCount", "vcpuCount", "memoryInGb",
    "containerDiskInGb", "volumeInGb", "volumeMountPath", "ports", "env", "dockerArgs",
    "uptimeSeconds", "locked",
]  # fmt: skip
OBJECT_TYPES: dict[str, dict[str, str | None]] = {
    "Pod": {
        **dict.fromkeys(_POD_SCALARS),
        "machine": "PodMachineInfo",
        "runtime": "PodRuntime",
    },
    "PodMachineInfo": dict.fromkeys(
        ["podHostId", "gpuDisplayName", "gpuTypeId", "location", "dataCenterId"]
    ),
    "PodRuntime": {
        "uptimeInSeconds": None,
        "ports": "PodRuntimePorts",
        "gpus": "PodRuntimeGpus",
        "container": "PodRuntimeContainer",
    },
    "PodRuntimePorts": dict.fromkeys(["ip", "isIpPublic", "privatePort", "publicPort", "type"]),
    "PodRuntimeGpus": dict.fromkeys(["id", "gpuUtilPercent", "memoryUtilPercent"]),
    "PodRuntimeContainer": dict.fromkeys(["cpuPercent", "memoryPercent"]),
    "User": {"id": None, "clientBalance": None, "currentSpendPerHr": None, "pods": "Pod"},
}

INPUT_TYPES: dict[str, dict[str, str]] = {
    "PodFindAndDeployOnDemandInput": {
        "name": "String",
        "imageName": "String",
        "templateId": "String",
        "gpuTypeId": "String",
        "gpuCount": "Int",
        "cloudType": "CloudTypeEnum",
        "containerDiskInGb": "Int",
        "volumeInGb": "Int",
        "volumeMountPath": "String",
        "minVcpuCount": "Int",
        "minMemoryInGb": "Int",
        "ports": "String",
        "env": "[EnvironmentVariableInput]",
        "dataCenterId": "String",
        "dockerArgs": "String",
        "supportPublicIp": "Boolean",
        "startSsh": "Boolean",
        "startJupyter": "Boolean",
        "networkVolumeId": "String",
        "countryCode": "String",
        "allowedCudaVersions": "[String]",
        "minCudaVersion": "String",
    },
    "PodTerminateInput": {"podId": "String!"},
    "PodFilter": {"podId": "String!"},
    "EnvironmentVariableInput": {"key": "String!", "value": "String!"},
}
ENUMS: dict[str, tuple[str, ...]] = {"CloudTypeEnum": ("ALL", "SECURE", "COMMUNITY")}
_SCALAR_CHECKS: dict[str, Callable[[Any], bool]] = {
    "String": lambda v: isinstance(v, str),
    "Int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "Float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "Boolean": lambda v: isinstance(v, bool),
}


class GraphQLRequestError(Exception):
    """The request cannot run at all: HTTP 400 with `errors` and no `data`."""

    def __init__(self, message: str, code: str = "GRAPHQL_VALIDATION_FAILED") -> None:
        super().__init__(message)
        self.message, self.code = message, code


class GraphQLFieldError(Exception):
    """The operation ran and failed: HTTP 200, `errors`, and the field null."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message, self.code = message, code


@dataclass(frozen=True)
class Plan:
    field: Field
    root: RootField
    input: dict[str, Any] | None


# ---------------------------------------------------------------------- endpoint


async def graphql_endpoint(request: Request) -> Response:
    ctx = context(request)
    payload, not_json = await read_json(request)
    body = payload if isinstance(payload, dict) else None
    seq = ctx.state.begin_call("graphql", request.method, request.url.path, None, body)
    response = await _respond(ctx, request, seq, payload, not_json)
    ctx.state.annotate_call(seq, status=response.status_code)
    return response


async def _respond(
    ctx: Context, request: Request, seq: int, payload: Any, not_json: str | None
) -> Response:
    if not is_authorized(request, ctx.api_key):
        return errors_response(401, "Unauthorized", "UNAUTHENTICATED")
    try:
        if not_json:
            raise GraphQLRequestError(not_json, "BAD_REQUEST")
        plan = plan_request(payload)
    except GraphQLRequestError as rejected:
        return errors_response(400, rejected.message, rejected.code)
    op = plan.field.name
    ctx.state.annotate_call(seq, op=op)
    return await run_guarded(
        ctx, op, lambda: _execute(ctx, plan, seq), lambda fault: render_fault(fault, plan.field)
    )


def errors_response(
    status: int, message: str, code: str, headers: dict[str, str] | None = None
) -> Response:
    body = {"errors": [{"message": message, "extensions": {"code": code}}]}
    return JSONResponse(body, status_code=status, headers=headers)


def field_error(field: Field, message: str, code: str) -> Response:
    key = field.response_key
    error = {"message": message, "path": [key], "extensions": {"code": code}}
    return JSONResponse({"errors": [error], "data": {key: None}})


def render_fault(fault: Fault, field: Field) -> Response:
    """How a queued fault looks on GraphQL.

    401 and 429 are HTTP statuses, as are gateway errors (502-504: they come from the edge,
    before GraphQL runs). 422 reads as the HTTP 400 of a request that cannot run (GraphQL's
    way to refuse a body that breaks the contract). Everything else is RunPod's GraphQL
    shape: HTTP 200 with `errors`; 500 reads like RunPod's generic failure, 400 like its
    capacity error (or, with a `detail` in other words, like a broken rule).
    """
    status = fault.status
    if status == 422:
        # GraphQL has no 422: a request that breaks the contract (unknown field, bad
        # variables) is refused with HTTP 400 before it runs, as `plan_request` does.
        message = fault.detail or 'Variable "$input" got invalid value.'
        return errors_response(400, message, "GRAPHQL_VALIDATION_FAILED")
    if status == 401:
        return errors_response(401, fault.detail or "Unauthorized", "UNAUTHENTICATED")
    if status == 429:
        message = fault.detail or "Too many requests, please slow down."
        return errors_response(429, message, "RATE_LIMITED", headers=retry_after(fault))
    if status in (502, 503, 504):
        return errors_response(status, fault.detail or HTTPStatus(status).phrase, "BAD_GATEWAY")
    if status == 400 and fault.detail and NO_CAPACITY_WORDS not in fault.detail.lower():
        # A 400 in other words than RunPod's capacity text is a broken rule, which RunPod
        # reports as BAD_USER_INPUT (as a create refused by placement rules is, below).
        return field_error(field, fault.detail, "BAD_USER_INPUT")
    message, code = {
        400: (NO_CAPACITY_MESSAGE, "SUPPLY_CONSTRAINT"),
        402: ("Your balance is too low to deploy this pod.", "INSUFFICIENT_BALANCE"),
        403: ("You do not have access to this resource.", "FORBIDDEN"),
    }.get(status, (GENERIC_ERROR_MESSAGE, "INTERNAL_SERVER_ERROR"))
    return field_error(field, fault.detail or message, code)


# ---------------------------------------------------------------------- planning


def plan_request(payload: Any) -> Plan:
    """Parse and validate everything that would make a real server answer 400."""
    if not isinstance(payload, dict) or not isinstance(payload.get("query"), str):
        raise GraphQLRequestError(
            "POST body must be a JSON object with a string query.", "BAD_REQUEST"
        )
    variables = payload.get("variables") or {}
    if not isinstance(variables, dict):
        raise GraphQLRequestError("variables must be a JSON object.", "BAD_REQUEST")
    try:
        operations = parse_document(payload["query"])
    except GraphQLSyntaxError as bad:
        raise GraphQLRequestError(str(bad), "GRAPHQL_PARSE_FAILED") from bad
    operation = _select_operation(operations, payload.get("operationName"))
    if len(operation.selections) != 1:
        raise GraphQLRequestError("The emulator answers exactly one root field per request.")
    field = operation.selections[0]
    root = ROOT_FIELDS.get(field.name)
    if root is None or root.operation_kind != operation.kind:
        parent = "Mutation" if operation.kind == "mutation" else "Query"
        raise GraphQLRequestError(f'Cannot query field "{field.name}" on type "{parent}".')
    _check_selection(root.result_type, field)
    return Plan(field, root, _resolve_input(root, field, operation, variables))


def _select_operation(operations: list[Operation], name: Any) -> Operation:
    if name is None:
        if len(operations) > 1:
            raise GraphQLRequestError(
                "Must provide operation name if query contains multiple operations.",
                "BAD_REQUEST",
            )
        return operations[0]
    for operation in operations:
        if operation.name == name:
            return operation
    raise GraphQLRequestError(f'Unknown operation named "{name}".', "BAD_REQUEST")


def _check_selection(type_name: str | None, field: Field) -> None:
    if type_name is None:
        if field.selections:
            raise GraphQLRequestError(
                f'Field "{field.name}" must not have a selection since its type has no subfields.'
            )
        return
    if not field.selections:
        raise GraphQLRequestError(
            f'Field "{field.name}" of type "{type_name}" must have a selection of subfields.'
        )
    fields = OBJECT_TYPES[type_name]
    for sub in field.selections:
        if sub.name == "__typename":
            continue
        if sub.name not in fields:
            raise GraphQLRequestError(f'Cannot query field "{sub.name}" on type "{type_name}".')
        if sub.arguments:
            raise GraphQLRequestError(f'Unknown argument on field "{type_name}.{sub.name}".')
        _check_selection(fields[sub.name], sub)


def _resolve_input(
    root: RootField, field: Field, operation: Operation, variables: dict[str, Any]
) -> dict[str, Any] | None:
    parent = "Mutation" if root.operation_kind == "mutation" else "Query"
    for argument in field.arguments:
        if root.input_type is None or argument != "input":
            raise GraphQLRequestError(
                f'Unknown argument "{argument}" on field "{parent}.{field.name}".'
            )
    if root.input_type is None:
        return None
    if "input" not in field.arguments:
        raise GraphQLRequestError(
            f'Field "{field.name}" argument "input" of type "{root.input_type}!" is required, '
            "but it was not provided."
        )
    raw = field.arguments["input"]
    if isinstance(raw, Variable):
        declared = operation.variable_types.get(raw.name, root.input_type)
        if declared.rstrip("!") != root.input_type:
            raise GraphQLRequestError(
                f'Variable "${raw.name}" of type "{declared}" used in position expecting '
                f'type "{root.input_type}!".'
            )
    value = _substitute(raw, operation, variables)
    problems = type_errors(root.input_type + "!", value, "input")
    if problems:
        raise GraphQLRequestError(
            f'Variable "$input" got invalid value; {problems[0]}', "BAD_USER_INPUT"
        )
    result: dict[str, Any] = value
    return result


def _substitute(value: Any, operation: Operation, variables: dict[str, Any]) -> Any:
    """Replace variables by their values; refuse inline literals (see module docstring)."""
    if isinstance(value, Variable):
        declared = operation.variable_types.get(value.name)
        if declared is None:
            raise GraphQLRequestError(f'Variable "${value.name}" is not defined.')
        if value.name not in variables and declared.endswith("!"):
            raise GraphQLRequestError(
                f'Variable "${value.name}" of required type "{declared}" was not provided.',
                "BAD_USER_INPUT",
            )
        return variables.get(value.name)
    if isinstance(value, Literal):
        raise GraphQLRequestError(
            "Inline argument values are not read by the emulator: pass inputs in `variables` "
            "(the driver must never interpolate data into query text).",
            "BAD_USER_INPUT",
        )
    if isinstance(value, list):
        return [_substitute(item, operation, variables) for item in value]
    return {key: _substitute(item, operation, variables) for key, item in value.items()}


def type_errors(type_ref: str, value: Any, path: str) -> list[str]:
    """GraphQL input coercion, reduced to the checks that catch driver mistakes."""
    if type_ref.endswith("!"):
        if value is None:
            return [f'Expected non-nullable type "{type_ref}" not to be null at "{path}".']
        type_ref = type_ref[:-1]
    if value is None:
        return []
    if type_ref.startswith("["):
        items = value if isinstance(value, list) else [value]
        return [
            e
            for i, item in enumerate(items)
            for e in type_errors(type_ref[1:-1], item, f"{path}[{i}]")
        ]
    if type_ref in INPUT_TYPES:
        return _input_object_errors(type_ref, value, path)
    ok = value in ENUMS[type_ref] if type_ref in ENUMS else _SCALAR_CHECKS[type_ref](value)
    return [] if ok else [f'Expected type "{type_ref}" at "{path}", got {value!r}.']


def _input_object_errors(type_name: str, value: Any, path: str) -> list[str]:
    if not isinstance(value, dict):
        return [f'Expected type "{type_name}" to be an object at "{path}".']
    fields = INPUT_TYPES[type_name]
    errors = [
        f'Field "{key}" is not defined by type "{type_name}" at "{path}".'
        for key in value
        if key not in fields
    ]
    for name, field_type in fields.items():
        errors += type_errors(field_type, value.get(name), f"{path}.{name}")
    return errors


# ---------------------------------------------------------------------- execution


async def _execute(ctx: Context, plan: Plan, seq: int) -> Response:
    try:
        value = _RESOLVERS[plan.field.name](ctx, plan, seq)
    except GraphQLFieldError as failed:
        return field_error(plan.field, failed.message, failed.code)
    key = plan.field.response_key
    return JSONResponse({"data": {key: project(value, plan.field, plan.root.result_type)}})


def _deploy(ctx: Context, plan: Plan, seq: int) -> Any:
    try:
        pod = ctx.state.create_pod(_spec(plan.input or {}))
    except PlacementError as refused:
        code = "SUPPLY_CONSTRAINT" if refused.no_capacity else "BAD_USER_INPUT"
        raise GraphQLFieldError(refused.detail, code) from refused
    ctx.state.annotate_call(seq, pod_id=pod.id)
    return render_pod(pod)


def _terminate(ctx: Context, plan: Plan, seq: int) -> Any:
    pod_id = (plan.input or {})["podId"]
    ctx.state.annotate_call(seq, pod_id=pod_id)
    if not ctx.state.terminate_pod(pod_id):
        # RunPod raises this as a plain error, which its server reports with the generic
        # code; only the message says "already gone".
        raise GraphQLFieldError(NOT_FOUND_TO_TERMINATE, "INTERNAL_SERVER_ERROR")
    return None


def _read(ctx: Context, plan: Plan, seq: int) -> Any:
    pod_id = (plan.input or {})["podId"]
    ctx.state.annotate_call(seq, pod_id=pod_id)
    pod = ctx.state.get_pod(pod_id)
    return render_pod(pod) if pod else None


def _myself(ctx: Context, plan: Plan, seq: int) -> Any:
    pods = ctx.state.list_pods()
    return {
        "id": "user_emulator",
        "clientBalance": 100.0,
        "currentSpendPerHr": round(sum(pod.cost_per_hr for pod in pods), 4),
        "pods": [render_pod(pod) for pod in pods],
    }


_RESOLVERS: dict[str, Callable[[Context, Plan, int], Any]] = {
    "podFindAndDeployOnDemand": _deploy,
    "podTerminate": _terminate,
    "pod": _read,
    "myself": _myself,
}


def _spec(given: dict[str, Any]) -> PodSpec:
    if not given.get("gpuTypeId"):
        raise GraphQLFieldError("gpuTypeId is required (CPU pods are REST only).", "BAD_USER_INPUT")
    template = given.get("templateId")
    image = given.get("imageName") or (f"runpod-template/{template}" if template else None)
    if not image:
        raise GraphQLFieldError("imageName or templateId is required.", "BAD_USER_INPUT")
    if (given.get("gpuCount") or 1) < 1:
        raise GraphQLFieldError("gpuCount must be at least 1.", "BAD_USER_INPUT")
    ports = tuple(p.strip() for p in (given.get("ports") or "").split(",") if p.strip())
    bad_ports = [port for port in ports if parse_port(port) is None]
    if bad_ports:
        raise GraphQLFieldError(f"Invalid ports: {', '.join(bad_ports)}.", "BAD_USER_INPUT")
    volume = given.get("volumeInGb") or 0
    path = given.get("volumeMountPath") or "/workspace"
    return PodSpec(
        name=given.get("name") or "",
        image=image,
        gpu_id=given["gpuTypeId"],
        gpu_count=given.get("gpuCount") or 1,
        vcpu_count=given.get("minVcpuCount") or 0,
        memory_gb=given.get("minMemoryInGb"),
        cloud=given.get("cloudType") or "ALL",
        data_center_ids=(given["dataCenterId"],) if given.get("dataCenterId") else (),
        args=given.get("dockerArgs") or "",
        disk=given.get("containerDiskInGb") or 50,
        ports=ports,
        env=tuple((item["key"], item["value"]) for item in given.get("env") or []),
        mounts={"persistent": {"size": volume, "path": path}} if volume else {},
    )


def render_pod(pod: Pod) -> dict[str, Any]:
    """Every Pod field the emulator knows; `project` trims it to what was asked."""
    persistent = pod.mounts.get("persistent") or {}
    gpu = GPU_TYPES_BY_ID.get(pod.gpu_id or "")
    return {
        "id": pod.id,
        "name": pod.name,
        "imageName": pod.image,
        # desiredStatus is intent, not readiness: it reads RUNNING while still provisioning.
        "desiredStatus": "EXITED" if pod.status == "EXITED" else "RUNNING",
        "lastStatusChange": f"Rented by User: {iso_time(pod.created_at)}",
        "machineId": pod.machine_id,
        "machine": {
            "podHostId": f"{pod.id}-{pod.machine_id[:8]}",
            "gpuDisplayName": gpu.name if gpu else None,
            "gpuTypeId": pod.gpu_id,
            "location": pod.data_center_id,
            "dataCenterId": pod.data_center_id,
        },
        "podType": "RESERVED",
        "costPerHr": pod.cost_per_hr,
        "adjustedCostPerHr": pod.cost_per_hr,
        "gpuCount": pod.gpu_count,
        "vcpuCount": pod.vcpu_count,
        "memoryInGb": pod.memory_gb,
        "containerDiskInGb": pod.disk,
        "volumeInGb": persistent.get("size", 0),
        "volumeMountPath": persistent.get("path", "/workspace"),
        "ports": ",".join(pod.ports),
        "env": [f"{key}={value}" for key, value in pod.env.items()],
        "dockerArgs": pod.args,
        "uptimeSeconds": pod.uptime,
        "locked": False,
        "runtime": _runtime(pod) if pod.status == "RUNNING" else None,
    }


def _runtime(pod: Pod) -> dict[str, Any]:
    return {
        "uptimeInSeconds": pod.uptime,
        "ports": [
            {
                "ip": m.ip,
                "isIpPublic": m.is_ip_public,
                "privatePort": m.private,
                "publicPort": m.public,
                "type": m.type,
            }
            for m in port_mappings(pod)
        ],
        "gpus": [
            {"id": f"GPU-{index}", "gpuUtilPercent": 0, "memoryUtilPercent": 0}
            for index in range(pod.gpu_count)
        ],
        "container": {"cpuPercent": 0, "memoryPercent": 0},
    }


def project(value: Any, field: Field, type_name: str | None) -> Any:
    """Keep only the selected fields (under their aliases), as GraphQL does."""
    if value is None or type_name is None:
        return value
    if isinstance(value, list):
        return [project(item, field, type_name) for item in value]
    fields = OBJECT_TYPES[type_name]
    return {
        sub.response_key: type_name
        if sub.name == "__typename"
        else project(value.get(sub.name), sub, fields[sub.name])
        for sub in field.selections
    }


ROUTES: list[Route] = [Route("/graphql", graphql_endpoint, methods=["POST"])]
