"""A pod's proxy URL, emulated: RunPod serves a pod's `<port>/http` ports at
`https://<pod_id>-<port>.proxy.runpod.net`; here at `<base_url>/_proxy/<pod_id>-<port>`
(`RunPodEmulator.proxy_url`, the scheduler's RUNPOD_PROXY_URL in tests). It answers 200
once the pod has been RUNNING for `pods_answer_after` seconds, and 502 before, or always
when that switch is off: RunPod's proxy answers 502 while nothing listens behind it.
A POST (a warm-pool hand-off) is answered alike: the pod's worker takes it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from .pipeline import context


async def proxied(request: Request) -> Response:
    pod_id, _, port = request.path_params["target"].rpartition("-")
    path = "/" + request.path_params.get("path", "")
    state = context(request).state
    if not port.isdigit() or not state.proxy_answers(pod_id, int(port)):
        return PlainTextResponse("502 Bad Gateway: the pod is not answering", status_code=502)
    return JSONResponse({"pod_id": pod_id, "port": int(port), "path": path})


ROUTES: list[Route] = [
    Route("/_proxy/{target}", proxied, methods=["GET", "HEAD", "POST"]),
    Route("/_proxy/{target}/{path:path}", proxied, methods=["GET", "HEAD", "POST"]),
]
