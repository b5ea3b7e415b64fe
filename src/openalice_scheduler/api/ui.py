"""The dashboard, `GET /ui`: one HTML page and its script and stylesheet, shipped as
package data (openalice_scheduler/ui/) and served as they are, with no build step.

Ungated, as /docs is (SecretGate gates /v1 only): the page holds no data. It asks the
operator for the secret and sends it with each call to the gated JSON endpoints."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter, HTTPException, Response

router = APIRouter(tags=["ui"], include_in_schema=False)

_UI = files("openalice_scheduler") / "ui"
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
# Read once: a handful of small files that change only with the package.
_ASSETS = {
    entry.name: entry.read_bytes()
    for entry in _UI.iterdir()
    if entry.is_file()
    and "." + entry.name.rpartition(".")[2] in _TYPES
    and entry.name != "index.html"
}
_PAGE = (_UI / "index.html").read_bytes()

# The page runs only its own script and talks only to this service: whatever a
# caller-given string (an owner id) holds, no other script can run or load, and no
# other site can frame the page to catch the secret being typed.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidated on every load, so an upgraded scheduler's page is never mixed with an
    # older script.
    "Cache-Control": "no-cache",
}


@router.get("/ui", summary="The dashboard page")
async def dashboard() -> Response:
    return Response(_PAGE, media_type=_TYPES[".html"], headers=_HEADERS)


@router.get("/ui/assets/{name}", summary="The dashboard's script and stylesheet")
async def dashboard_asset(name: str) -> Response:
    body = _ASSETS.get(name)
    if body is None:
        raise HTTPException(status_code=404, detail="no such dashboard asset")
    return Response(body, media_type=_TYPES["." + name.rpartition(".")[2]], headers=_HEADERS)
