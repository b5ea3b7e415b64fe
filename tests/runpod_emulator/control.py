"""Test-only control surface: `/_emulator/faults`, `/_emulator/reset`, `/_emulator/state`.

Same switches as the Python methods, for a scheduler running in another process (e.g. the
emulator started with `python -m tests.runpod_emulator`). These endpoints need no key and
are not recorded in the call log: they are the test's hands, not the driver's traffic.
"""

from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .catalog import AVAILABILITY_LEVELS
from .pipeline import context, problem, read_json
from .rest import render_pod
from .state import OPERATION_TARGETS, POD_STATUSES, EmulatorState

_LEVEL = {"enum": list(AVAILABILITY_LEVELS)}
_TARGET = {"enum": sorted(OPERATION_TARGETS)}
_SECONDS = {"type": "number", "minimum": 0}

# `additionalProperties: false` everywhere: a misspelt switch must fail the test that sent
# it, not silently leave the emulator healthy.
FAULTS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "provision_delay": _SECONDS,
        "pods_answer_after": {"type": ["number", "null"], "minimum": 0},
        "no_capacity": {"type": "object", "additionalProperties": {"type": "boolean"}},
        "no_capacity_at_create": {
            "type": "object",
            "additionalProperties": {"type": "boolean"},
        },
        "stock": {"type": "object", "additionalProperties": _LEVEL},
        "capacity": {
            "type": "object",
            "additionalProperties": {"type": ["integer", "null"], "minimum": 0},
        },
        "price": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"secure": _SECONDS, "community": _SECONDS},
            },
        },
        "data_centers": {"type": "array", "items": {"type": "string"}},
        "data_center_stock": {
            "type": "object",
            "additionalProperties": {
                "oneOf": [_LEVEL, {"type": "object", "additionalProperties": _LEVEL}]
            },
        },
        "fail_next": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["status"],
                "properties": {
                    "status": {"type": "integer", "minimum": 400, "maximum": 599},
                    "count": {"type": "integer", "minimum": 1},
                    "op": {"oneOf": [_TARGET, {"type": "null"}]},
                    "retry_after": {"type": ["integer", "null"], "minimum": 0},
                    "after_create": {"type": "boolean"},
                    "detail": {"type": ["string", "null"]},
                },
            },
        },
        "delay": {
            "type": "object",
            "propertyNames": {"enum": ["*", *sorted(OPERATION_TARGETS)]},
            "additionalProperties": _SECONDS,
        },
        "vanish_pods": {"type": "array", "items": {"type": "string"}},
        "pod_status": {
            "type": "object",
            "additionalProperties": {"enum": [*POD_STATUSES, None]},
        },
    },
}
_FAULTS_VALIDATOR = Draft202012Validator(FAULTS_SCHEMA)


def fault_config_errors(config: Any) -> list[str]:
    return sorted(f"{e.json_path}: {e.message}" for e in _FAULTS_VALIDATOR.iter_errors(config))


def apply_fault_config(state: EmulatorState, config: dict[str, Any]) -> None:
    """Apply a validated `/_emulator/faults` body through the same methods tests call."""
    if "provision_delay" in config:
        state.provision_delay = config["provision_delay"]
    if "pods_answer_after" in config:
        state.pods_answer_after = config["pods_answer_after"]
    for gpu_id, enabled in config.get("no_capacity", {}).items():
        state.set_no_capacity(gpu_id, enabled)
    for gpu_id, enabled in config.get("no_capacity_at_create", {}).items():
        state.set_no_capacity_at_create(gpu_id, enabled)
    for gpu_id, level in config.get("stock", {}).items():
        state.set_stock(gpu_id, level)
    for gpu_id, gpus in config.get("capacity", {}).items():
        state.set_capacity(gpu_id, gpus)
    for gpu_id, price in config.get("price", {}).items():
        state.set_price(gpu_id, secure=price.get("secure"), community=price.get("community"))
    if "data_centers" in config:
        state.set_data_centers(config["data_centers"])
    for dc_id, level in config.get("data_center_stock", {}).items():
        if isinstance(level, str):
            state.set_data_center_stock(dc_id, level)
        else:
            for gpu_id, gpu_level in level.items():
                state.set_data_center_stock(dc_id, gpu_level, gpu_id)
    for fault in config.get("fail_next", []):
        state.fail_next(
            fault["status"],
            fault.get("count", 1),
            op=fault.get("op"),
            retry_after=fault.get("retry_after"),
            after_create=fault.get("after_create", False),
            detail=fault.get("detail"),
        )
    for op, seconds in config.get("delay", {}).items():
        state.set_delay(seconds, None if op == "*" else op)
    for pod_id in config.get("vanish_pods", []):
        state.vanish_pod(pod_id)
    for pod_id, status in config.get("pod_status", {}).items():
        state.set_pod_status(pod_id, status)


def state_snapshot(state: EmulatorState) -> dict[str, Any]:
    """Pods (REST shape), the call log and the fault settings; never the API key."""
    return {
        "pods": [render_pod(pod) for pod in state.list_pods()],
        "calls": [call.as_dict() for call in state.calls()],
        "faults": state.faults_snapshot(),
    }


async def post_faults(request: Request) -> Response:
    config, not_json = await read_json(request)
    if not_json:
        return problem(400, not_json)
    errors = fault_config_errors(config)
    if errors:
        return problem(422, "Fault settings rejected.", errors=errors)
    state = context(request).state
    try:
        apply_fault_config(state, config)
    except (KeyError, ValueError) as refused:
        return problem(400, f"fault setting refused: {refused}")
    return JSONResponse(state.faults_snapshot())


async def post_reset(request: Request) -> Response:
    context(request).state.reset()
    return Response(status_code=204)


async def get_state(request: Request) -> Response:
    return JSONResponse(state_snapshot(context(request).state))


ROUTES: list[Route] = [
    Route("/_emulator/faults", post_faults, methods=["POST"]),
    Route("/_emulator/reset", post_reset, methods=["POST"]),
    Route("/_emulator/state", get_state, methods=["GET"]),
]
