"""The REST v2 driver of the RunPod API, `RestClient`: how a `PodRequest` becomes a
`POST /v2/pods` body, and how REST answers decode, pods from JSON and errors from
application/problem+json (a 400 is told apart as no capacity by its words alone)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from openalice_scheduler.providers.runpod.base import (
    GpuStock,
    Pod,
    PodRequest,
    RunPodClient,
    _json,
    _kind_for_status,
    _says_no_capacity,
)


class RestClient(RunPodClient):
    """REST v2: `POST /v2/pods`, `GET /v2/pods[/{id}]`, `DELETE /v2/pods/{id}`,
    `GET /v2/catalog/gpus`. Errors are application/problem+json."""

    api = "rest"

    async def create_pod(self, request: PodRequest) -> Pod:
        body: dict[str, Any] = {
            "name": request.name,
            "cloud": request.cloud,
            "ports": list(request.ports),
            "env": dict(request.env),
        }
        if request.template_id:
            body["templateId"] = request.template_id
        else:
            body["image"] = request.image
            body["disk"] = request.disk_gb
        if request.gpu_type_id:
            body["gpu"] = {"id": request.gpu_type_id, "count": 1}
        else:
            body["cpu"] = {"id": request.cpu_flavor, "vcpuCount": request.vcpu_count}
        if request.data_center_ids:
            body["dataCenterIds"] = list(request.data_center_ids)
        response = await self._send("POST", "/v2/pods", json=body, retry_server_errors=False)
        return _rest_pod(self._check(response))

    async def get_pod(self, pod_id: str) -> Pod | None:
        response = await self._send("GET", f"/v2/pods/{pod_id}", retry_server_errors=True)
        if response.status_code == 404:
            return None
        return _rest_pod(self._check(response))

    async def list_pods(self) -> list[Pod]:
        response = await self._send("GET", "/v2/pods", retry_server_errors=True)
        return [_rest_pod(item) for item in self._check(response).get("pods", [])]

    async def terminate_pod(self, pod_id: str) -> None:
        response = await self._send("DELETE", f"/v2/pods/{pod_id}", retry_server_errors=True)
        if response.status_code in (204, 404):
            return
        self._check(response)

    async def gpu_catalog(self) -> list[GpuStock]:
        response = await self._send(
            "GET",
            "/v2/catalog/gpus",
            params={"include": "AVAILABILITY", "product": "POD"},
            retry_server_errors=True,
        )
        stock = []
        for gpu in self._check(response).get("gpus", []):
            price = gpu.get("price") or {}
            stock.append(
                GpuStock(
                    id=gpu["id"],
                    availability=gpu.get("availability") or "NONE",
                    price_secure=float(price.get("secure") or 0.0),
                    price_community=float(price.get("community") or 0.0),
                    data_centers={
                        dc["id"]: dc.get("availability", "NONE")
                        for dc in gpu.get("dataCenters") or []
                    },
                )
            )
        return stock

    def _check(self, response: httpx.Response) -> Any:
        status = response.status_code
        if status < 400:
            return _json(response) if response.content else {}
        detail = _problem_detail(response)
        raise self._error(
            _kind_for_status(status),
            detail,
            status,
            no_capacity=status == 400 and _says_no_capacity(detail),
        )


def _rest_pod(item: Mapping[str, Any]) -> Pod:
    env = item.get("env") or {}
    cost, gpu = item.get("cost"), item.get("gpu")
    return Pod(
        id=item["id"],
        name=item.get("name") or "",
        status=item.get("status") or "",
        env=env if isinstance(env, dict) else {},
        cost_per_hr=float(cost) if isinstance(cost, int | float) else None,
        gpu_type=str(gpu.get("id")) if isinstance(gpu, dict) and gpu.get("id") else None,
    )


def _problem_detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}"
    if not isinstance(body, dict):
        return f"HTTP {response.status_code}"
    detail = str(body.get("detail") or body.get("title") or f"HTTP {response.status_code}")
    errors = body.get("errors")
    if errors:
        detail += " (" + "; ".join(str(e) for e in errors[:3]) + ")"
    return detail[:500]
