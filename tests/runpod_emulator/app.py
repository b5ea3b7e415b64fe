"""The ASGI application: REST v2 + GraphQL + control routes on one Starlette app.

Plain Starlette rather than FastAPI on purpose: FastAPI would answer validation failures in
its own 422 shape, and the whole point here is to answer in RunPod's.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, Route

from . import control, graphql, proxy, rest
from .openapi import OpenApiSchemas
from .pipeline import Context, problem
from .state import EmulatorState


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and methods answer problem+json too, like the rest of the API."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        allow = ", ".join(sorted(_methods_for(request)))
        detail = "The requested method is not allowed for this path."
        return problem(405, detail, headers={"Allow": allow})
    detail = "resource not found" if exc.status_code == 404 else str(exc.detail)
    return problem(exc.status_code, detail)


def _methods_for(request: Request) -> set[str]:
    """Every method some route serves on this path (Starlette's own Allow names only one)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE and isinstance(route, Route):
            methods |= route.methods or set()
    return methods


def build_app(state: EmulatorState, api_key: str, schemas: OpenApiSchemas) -> Starlette:
    app = Starlette(
        routes=[*rest.ROUTES, *graphql.ROUTES, *control.ROUTES, *proxy.ROUTES],
        exception_handlers={HTTPException: _http_error},
    )
    app.state.ctx = Context(state=state, api_key=api_key, schemas=schemas)
    return app
