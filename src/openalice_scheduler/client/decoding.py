"""How an answer of the scheduler becomes a result: a success body is validated into the
call's model, an error answer is raised as the typed exception of `errors.py` that its
`error` code names, and a code this client has no class for (a newer service, a proxy)
still comes back as a `SchedulerError` with that code and status."""

from __future__ import annotations

import builtins
import functools
from typing import TypeVar, cast

import httpx
from pydantic import ValidationError

from openalice_scheduler import errors
from openalice_scheduler.client.core import _Call
from openalice_scheduler.errors import SchedulerError

T = TypeVar("T")


def _decode(response: httpx.Response, call: _Call[T]) -> T:
    if not response.is_success:
        raise _error(response)
    if call.adapter is None:
        return cast(T, None)
    try:
        return call.adapter.validate_json(response.content)
    except ValidationError:
        raise _unknown_error("invalid_response", response.status_code)(
            f"the scheduler answered {call.method} {call.path} with an unexpected body"
        ) from None


def _error(response: httpx.Response) -> SchedulerError:
    """The typed exception for an error answer, by its `error` code."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("error"), str):
        # Not the scheduler's own answer (a proxy, say); its body is not repeated.
        body = {
            "error": f"http_{response.status_code}",
            "message": f"HTTP {response.status_code} {response.reason_phrase} "
            f"from {response.request.method} {response.request.url.path}",
        }
    code = body["error"]
    cls = _KNOWN_ERRORS.get(code) or _unknown_error(code, response.status_code)
    headers = (
        {"Retry-After": response.headers["Retry-After"]}
        if "Retry-After" in response.headers
        else None
    )
    exc = cls(str(body.get("message") or code), headers=headers)
    exc.details = {k: v for k, v in body.items() if k not in ("error", "message")}
    return exc


def _known_errors() -> dict[str, type[SchedulerError]]:
    """code → class, for the tree in errors.py (the base class is `internal_error`)."""
    found: dict[str, type[SchedulerError]] = {}
    pending: builtins.list[type[SchedulerError]] = [SchedulerError]
    while pending:
        cls = pending.pop()
        if cls.__module__ == errors.__name__:
            found.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return found


_KNOWN_ERRORS = _known_errors()


@functools.lru_cache(maxsize=64)
def _unknown_error(code: str, status: int) -> type[SchedulerError]:
    """A SchedulerError whose `code` and `status` are those of an answer this client has
    no class for (a newer service, a proxy): still caught by `except SchedulerError`."""
    return cast(
        type[SchedulerError],
        type(
            "SchedulerError",
            (SchedulerError,),
            {"code": code, "status": status, "__module__": __name__},
        ),
    )
