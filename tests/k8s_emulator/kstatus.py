"""Kubernetes `Status` objects: every error the emulator answers is one, as the real
API server writes it (`metav1.Status`, with `reason`, `details` and `code`)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "AlreadyExists",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}
DEFAULT_MESSAGES = {
    429: "Too many requests, please try again later.",
    500: "Internal error occurred: emulated failure",
    503: "the server is currently unable to handle the request",
}


class ApiError(Exception):
    """Raised by a handler: answered as a Status of `code`."""

    def __init__(
        self,
        code: int,
        message: str,
        *,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason if reason is not None else REASONS.get(code, "")
        self.details = details
        self.headers = headers or {}

    def status(self) -> dict[str, Any]:
        return status_object(self.code, self.message, self.reason, self.details)


def status_object(
    code: int, message: str, reason: str, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
    }
    if details:
        status["details"] = details
    status["code"] = code
    return status


def success(kind: str, name: str, uid: str) -> dict[str, Any]:
    """What a delete of a non-pod object answers."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": {"name": name, "kind": kind, "uid": uid},
    }


def respond(error: ApiError) -> web.Response:
    # Exactly `application/json`, as the API server writes it (no charset): lightkube
    # turns an error into its ApiError only for that Content-Type.
    return web.Response(
        status=error.code,
        body=json.dumps(error.status()).encode(),
        headers={"Content-Type": "application/json", **error.headers},
    )


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, f'{resource} "{name}" not found', details={"name": name, "kind": resource})


def already_exists(resource: str, name: str) -> ApiError:
    return ApiError(
        409, f'{resource} "{name}" already exists', details={"name": name, "kind": resource}
    )


def invalid(kind: str, name: str, causes: list[tuple[str, str, str]]) -> ApiError:
    """422: causes are (field, reason, message) as field.ErrorList writes them."""
    text = ", ".join(f"{f}: {m}" for f, _, m in causes)
    if len(causes) > 1:
        text = "[" + text + "]"
    return ApiError(
        422,
        f'{kind} "{name}" is invalid: {text}',
        details={
            "name": name,
            "kind": kind,
            "causes": [{"reason": r, "message": m, "field": f} for f, r, m in causes],
        },
    )


def too_many_requests(retry_after: int = 1) -> ApiError:
    return ApiError(
        429,
        DEFAULT_MESSAGES[429],
        details={"retryAfterSeconds": retry_after},
        headers={"Retry-After": str(retry_after)},
    )
