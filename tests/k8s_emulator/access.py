"""Who may do what: the bearer token (401), the emulated faults (429/500/503, a dropped
connection), RBAC Role
rules (403 in the real authorizer's words), and the audit list of every served request.

A request's attributes follow the API server's RequestInfo: GET of an item is `get`, of a
collection `list`, with `?watch=true` `watch`; POST `create`; PUT `update`; PATCH `patch`;
DELETE of an item `delete`, of a collection `deletecollection`.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .kstatus import DEFAULT_MESSAGES, ApiError, too_many_requests

DEFAULT_USER = "system:serviceaccount:openalice:openalice-scheduler"


@dataclass
class RequestInfo:
    verb: str
    resource: str | None  # None: a non-resource URL (/version, /api, ...)
    namespace: str | None
    name: str | None
    path: str


def request_info(request: web.Request) -> RequestInfo:
    parts = [p for p in request.path.split("/") if p]
    method = request.method.upper()
    if len(parts) < 3 or parts[:2] != ["api", "v1"]:
        return RequestInfo(method.lower(), None, None, None, request.path)
    rest = parts[2:]
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0]
    name = rest[1] if len(rest) > 1 else None
    if resource == "namespaces" and namespace is None and len(rest) > 1:
        name = rest[1]
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"  # a subresource
    watch = request.query.get("watch") in ("true", "1")
    verb = {
        "GET": "watch" if watch else ("get" if name else "list"),
        "HEAD": "get" if name else "list",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if name else "deletecollection",
    }.get(method, method.lower())
    return RequestInfo(verb, resource, namespace, name, request.path)


@dataclass
class Fault:
    remaining: int
    code: int
    verb: str | None = None
    resource: str | None = None
    retry_after: int = 1
    message: str | None = None
    # The request is carried out, and only its answer is the error: an answer lost on
    # the way (the client cannot tell whether it happened).
    after: bool = False
    # No answer at all: the connection is closed as the request arrives (an API server
    # restarting, a load balancer's reset), which the client sees as a transport error.
    drop: bool = False

    def matches(self, info: RequestInfo) -> bool:
        return (self.verb is None or self.verb == info.verb) and (
            self.resource is None or self.resource == info.resource
        )


class Dropped(Exception):
    """The request's connection is to be closed without an answer (`Fault.drop`)."""


@dataclass
class Access:
    token: str
    user: str = DEFAULT_USER
    rules: list[dict[str, Any]] | None = None
    faults: list[Fault] = field(default_factory=list)
    audit: list[dict[str, Any]] = field(default_factory=list)

    def authenticate(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip().encode(), self.token.encode()
        )

    def fault_for(self, info: RequestInfo) -> tuple[ApiError, bool] | None:
        """The error to answer `info` with, and whether only after carrying it out."""
        for fault in self.faults:
            if fault.remaining > 0 and fault.matches(info):
                fault.remaining -= 1
                self.faults = [f for f in self.faults if f.remaining > 0]
                if fault.drop:
                    raise Dropped()
                if fault.code == 429:
                    error = too_many_requests(fault.retry_after)
                else:
                    error = ApiError(
                        fault.code,
                        fault.message or DEFAULT_MESSAGES.get(fault.code, "emulated failure"),
                    )
                if fault.message:
                    error.message = fault.message
                return error, fault.after
        return None

    def authorize(self, info: RequestInfo) -> None:
        """403 unless a rule allows the verb on the resource (no rules: all allowed)."""
        if self.rules is None or info.resource is None:
            return
        for rule in self.rules:
            groups, resources, verbs = (
                rule.get("apiGroups") or [],
                rule.get("resources") or [],
                rule.get("verbs") or [],
            )
            names = rule.get("resourceNames") or []
            if (
                ("" in groups or "*" in groups)
                and (info.resource in resources or "*" in resources)
                and (info.verb in verbs or "*" in verbs)
                and (not names or info.name in names)
            ):
                return
        resource = info.resource.split("/")[0]
        subject = f'{resource} "{info.name}"' if info.name else resource
        scope = f'in the namespace "{info.namespace}"' if info.namespace else "at the cluster scope"
        sub = info.resource.split("/")[1] if "/" in info.resource else ""
        what = f'resource "{resource}"' + (f' in subresource "{sub}"' if sub else "")
        details: dict[str, Any] = {"kind": resource}
        if info.name:
            details["name"] = info.name
        raise ApiError(
            403,
            f'{subject} is forbidden: User "{self.user}" '
            f'cannot {info.verb} {what} in API group "" {scope}',
            details=details,
        )

    def record(self, info: RequestInfo, code: int, **extra: Any) -> None:
        entry: dict[str, Any] = {
            "time": time.time(),
            "verb": info.verb,
            "resource": info.resource,
            "namespace": info.namespace,
            "name": info.name,
            "path": info.path,
            "code": code,
        }
        entry.update({k: v for k, v in extra.items() if v is not None})
        self.audit.append(entry)
