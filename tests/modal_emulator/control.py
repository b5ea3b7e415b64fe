"""Test-only control API on loopback (HTTP, JSON): the tests' hands, not the client's
traffic. It needs no credentials and is not in the call log.

- `GET  /_emulator/healthz`: 200 once the emulator serves.
- `GET  /_emulator/state`: sandboxes (what was asked, env keys only), calls, switches,
  faults, apps, images, secret keys, the clock.
- `POST /_emulator/switches`: set switches (body below; unknown keys: 422).
- `POST /_emulator/clock` `{"advance": seconds}`: move the emulator's clock forward;
  answers `{"now", "frozen", "ended": [sandbox ids ended by their deadline]}` once they
  are ended. `{"frozen": true}` stops real time's part in the clock (only `advance` moves
  it then, so a move ends exactly the sandboxes it reaches), `false` restarts it; both
  keys may come together (freezing first).
- `POST /_emulator/sandboxes/{sandbox_id}/oom-kill`: the kernel OOM-kills its container
  (SIGKILL) at its memory limit; answers `{"result": ...}` once it ended, as Modal
  records it (KERNEL_OOM_KILL, exit code 137). 404: no such sandbox; 409: not running,
  or no memory limit.
- `POST /_emulator/reset`: end and forget every sandbox, clear switches, faults, calls
  and the clock (apps, images and secrets stay).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from grpclib import Status
from jsonschema import Draft202012Validator

from tests.emulator_common import control_app, read_json

from .engine import SandboxEngine
from .state import EmulatorState, Fault, result_dict

_SECONDS = {"type": "number", "minimum": 0}
_STATUS = {"enum": [s.name for s in Status if s is not Status.OK]}
SWITCHES_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "schedule_delay": _SECONDS,
        "hold_tunnels": {"type": "boolean"},
        # GPU types refused at create ("*": every create, "": CPU-only ones); [] clears.
        "no_capacity": {"type": "array", "items": {"type": "string"}},
        "max_sandboxes": {"type": ["integer", "null"], "minimum": 0},
        "list_page_size": {"type": "integer", "minimum": 1},
        "rpc_delay": {"type": "object", "additionalProperties": _SECONDS},
        "fail_next": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["rpc"],
                "properties": {
                    "rpc": {"type": "string", "minLength": 1},
                    "calls": {"type": "integer", "minimum": 1},
                    "status": _STATUS,
                    "message": {"type": "string"},
                    "per_attempt": {"type": "boolean"},
                },
            },
        },
        "clear_faults": {"type": "boolean"},
    },
}
_VALIDATOR = Draft202012Validator(SWITCHES_SCHEMA)
_CLOCK_VALIDATOR = Draft202012Validator(
    {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {"advance": _SECONDS, "frozen": {"type": "boolean"}},
    }
)


def switch_errors(body: Any) -> list[str]:
    return sorted(f"{e.json_path}: {e.message}" for e in _VALIDATOR.iter_errors(body))


def apply_switches(state: EmulatorState, body: dict[str, Any]) -> None:
    settings = state.settings
    if "schedule_delay" in body:
        settings.schedule_delay = float(body["schedule_delay"])
    if "hold_tunnels" in body:
        settings.hold_tunnels = body["hold_tunnels"]
    if "no_capacity" in body:
        settings.no_capacity = set(body["no_capacity"])
    if "max_sandboxes" in body:
        settings.max_sandboxes = body["max_sandboxes"]
    if "list_page_size" in body:
        settings.list_page_size = body["list_page_size"]
    for pattern, seconds in body.get("rpc_delay", {}).items():
        if seconds:
            settings.rpc_delay[pattern] = float(seconds)
        else:
            settings.rpc_delay.pop(pattern, None)
    if body.get("clear_faults"):
        state.faults.clear()
    for fault in body.get("fail_next", []):
        status = Status[fault.get("status", "UNAVAILABLE")]
        state.faults.append(
            Fault(
                rpc=fault["rpc"],
                status=status,
                calls=fault.get("calls", 1),
                message=fault.get("message") or f"{fault['rpc']}: {status.name} (emulated)",
                per_attempt=fault.get("per_attempt", False),
            )
        )


def make_control_app(state: EmulatorState, engine: SandboxEngine) -> web.Application:
    routes = web.RouteTableDef()

    @routes.get("/_emulator/state")
    async def get_state(request: web.Request) -> web.Response:
        return web.json_response(state.snapshot())

    @routes.post("/_emulator/switches")
    async def post_switches(request: web.Request) -> web.Response:
        body = await read_json(request)
        errors = switch_errors(body)
        if errors:
            return web.json_response({"errors": errors}, status=422)
        apply_switches(state, body)
        engine.dispatch()  # a raised `max_sandboxes` places queued sandboxes now
        return web.json_response(
            {"settings": state.settings.as_dict(), "faults": [f.as_dict() for f in state.faults]}
        )

    @routes.post("/_emulator/clock")
    async def post_clock(request: web.Request) -> web.Response:
        body = await read_json(request)
        errors = sorted(e.message for e in _CLOCK_VALIDATOR.iter_errors(body))
        if errors:
            return web.json_response({"errors": errors}, status=422)
        if "frozen" in body:
            state.freeze_clock(body["frozen"])
        ended = await engine.advance_clock(float(body.get("advance", 0)))
        frozen = state.clock_frozen_at is not None
        return web.json_response({"now": state.now(), "frozen": frozen, "ended": ended})

    @routes.post("/_emulator/sandboxes/{sandbox_id}/oom-kill")
    async def post_oom_kill(request: web.Request) -> web.Response:
        record = state.sandboxes.get(request.match_info["sandbox_id"])
        if record is None:
            raise web.HTTPNotFound(text=f"no sandbox {request.match_info['sandbox_id']}")
        try:
            result = await engine.oom_kill(record)
        except ValueError as exc:
            raise web.HTTPConflict(text=str(exc)) from exc
        return web.json_response({"result": result_dict(result)})

    @routes.post("/_emulator/reset")
    async def post_reset(request: web.Request) -> web.Response:
        await engine.reset()
        return web.Response(status=204)

    return control_app(routes)
