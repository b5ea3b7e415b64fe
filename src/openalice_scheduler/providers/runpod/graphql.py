"""The GraphQL driver of the RunPod API, `GraphQLClient`, the original one: its queries
and mutations (inputs always as variables), a v2-like pod status and env from GraphQL's
shapes, and the decoding of errors, which RunPod mostly answers in-band with HTTP 200:
by `extensions.code` where it says enough, else by the message's words."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from openalice_scheduler.providers.runpod.base import (
    ErrorKind,
    Pod,
    PodRequest,
    RunPodClient,
    RunPodError,
    _json,
    _kind_for_status,
    _says_no_capacity,
)


class GraphQLClient(RunPodClient):
    """GraphQL at `POST /graphql`; inputs always travel as variables. RunPod answers
    HTTP 200 with an `errors` list for most failures, so those are decoded here."""

    api = "graphql"

    CREATE = (
        "mutation($input: PodFindAndDeployOnDemandInput!) { "
        "podFindAndDeployOnDemand(input: $input) { id imageName machineId desiredStatus "
        "costPerHr } }"
    )
    TERMINATE = "mutation($input: PodTerminateInput!) { podTerminate(input: $input) }"
    READ = (
        "query($input: PodFilter!) { pod(input: $input) { id name desiredStatus "
        "runtime { ports { ip isIpPublic privatePort publicPort type } } } }"
    )
    # `runtime` (null until the pod runs) says whether a listed pod is ready.
    LIST = "query { myself { pods { id name desiredStatus env runtime { uptimeInSeconds } } } }"

    async def create_pod(self, request: PodRequest) -> Pod:
        if not request.gpu_type_id:
            raise RunPodError(ErrorKind.rejected, "CPU pods are not served through GraphQL")
        value: dict[str, Any] = {
            "name": request.name,
            "gpuTypeId": request.gpu_type_id,
            "gpuCount": 1,
            "cloudType": request.cloud,
            "containerDiskInGb": request.disk_gb,
            "volumeInGb": 0,
            "ports": ",".join(request.ports),
            "env": [{"key": k, "value": v} for k, v in request.env.items()],
        }
        if request.template_id:
            value["templateId"] = request.template_id
        else:
            value["imageName"] = request.image
        if request.data_center_ids:
            value["dataCenterId"] = request.data_center_ids[0]
        data = await self._call(
            self.CREATE, {"input": value}, "podFindAndDeployOnDemand", retry_server_errors=False
        )
        pod = data["podFindAndDeployOnDemand"]
        if pod is None:
            raise RunPodError(ErrorKind.server, "RunPod returned no pod")
        return Pod(
            id=pod["id"],
            name=request.name,
            status="PROVISIONING",
            cost_per_hr=_number(pod.get("costPerHr")),
            gpu_type=request.gpu_type_id,
        )

    async def get_pod(self, pod_id: str) -> Pod | None:
        data = await self._call(
            self.READ, {"input": {"podId": pod_id}}, "pod", retry_server_errors=True
        )
        pod = data.get("pod")
        if pod is None:
            return None
        return Pod(id=pod["id"], name=pod.get("name") or "", status=_graphql_status(pod))

    async def list_pods(self) -> list[Pod]:
        data = await self._call(self.LIST, {}, "myself", retry_server_errors=True)
        pods = (data.get("myself") or {}).get("pods") or []
        return [
            Pod(
                id=p["id"],
                name=p.get("name") or "",
                status=_graphql_status(p),
                env=_graphql_env(p.get("env")),
            )
            for p in pods
        ]

    async def terminate_pod(self, pod_id: str) -> None:
        try:
            await self._call(
                self.TERMINATE,
                {"input": {"podId": pod_id}},
                "podTerminate",
                retry_server_errors=True,
            )
        except RunPodError as exc:
            if exc.kind == ErrorKind.not_found:
                return
            raise

    async def _call(
        self,
        query: str,
        variables: dict[str, Any],
        field_name: str,
        *,
        retry_server_errors: bool,
    ) -> dict[str, Any]:
        attempt = 0
        while True:
            attempt += 1
            response = await self._send(
                "POST",
                "/graphql",
                json={"query": query, "variables": variables},
                retry_server_errors=retry_server_errors,
            )
            status = response.status_code
            if status >= 400:
                # HTTP 400 on GraphQL is a request that cannot run at all (syntax, unknown
                # field, bad variables): our request broke the contract, like REST's 422.
                # Capacity and rule refusals come in-band with HTTP 200 instead.
                kind = ErrorKind.invalid if status == 400 else _kind_for_status(status)
                raise self._error(kind, _graphql_http_detail(response), status)
            payload = _json(response)
            errors = payload.get("errors") or []
            if not errors:
                return payload.get("data") or {}
            found = _graphql_error(errors[0])
            error = self._error(
                found.kind, found.detail, found.status, no_capacity=found.no_capacity
            )
            # In-band 5xx: repeat like an HTTP 5xx where that is safe.
            if error.kind == ErrorKind.server and retry_server_errors and attempt <= self.retries:
                await self._sleep_backoff(attempt)
                continue
            raise error


def _graphql_status(pod: Mapping[str, Any]) -> str:
    """A v2-like status: `desiredStatus` says nothing about readiness, `runtime` does."""
    desired = pod.get("desiredStatus")
    if desired in ("EXITED", "TERMINATED"):
        return str(desired)
    return "RUNNING" if pod.get("runtime") else "PROVISIONING"


def _graphql_env(env: Any) -> dict[str, str]:
    if isinstance(env, dict):
        return {str(k): str(v) for k, v in env.items()}
    out: dict[str, str] = {}
    for item in env or []:
        if isinstance(item, str) and "=" in item:
            key, value = item.split("=", 1)
            out[key] = value
        elif isinstance(item, dict) and "key" in item:
            out[str(item["key"])] = str(item.get("value", ""))
    return out


_GRAPHQL_CODES = {
    "SUPPLY_CONSTRAINT": ErrorKind.rejected,
    "BAD_USER_INPUT": ErrorKind.rejected,
    "GRAPHQL_VALIDATION_FAILED": ErrorKind.invalid,
    "UNAUTHENTICATED": ErrorKind.unauthorized,
    "INSUFFICIENT_BALANCE": ErrorKind.payment,
    "FORBIDDEN": ErrorKind.forbidden,
    "INTERNAL_SERVER_ERROR": ErrorKind.server,
}


def _graphql_error(error: Mapping[str, Any]) -> RunPodError:
    message = str(error.get("message") or "unknown GraphQL error")[:500]
    code = str((error.get("extensions") or {}).get("code") or "")
    lowered = message.lower()
    no_capacity = code == "SUPPLY_CONSTRAINT" or _says_no_capacity(message)
    if no_capacity or code == "BAD_USER_INPUT":
        # A refusal of this request (capacity or a broken rule, e.g. "data center not
        # found"): the next candidate may be placed.
        return RunPodError(ErrorKind.rejected, message, no_capacity=no_capacity)
    if "not found" in lowered:
        # `pod not found to terminate` comes with the generic code: only the text says it.
        return RunPodError(ErrorKind.not_found, message)
    if "balance" in lowered:
        return RunPodError(ErrorKind.payment, message)
    return RunPodError(_GRAPHQL_CODES.get(code, ErrorKind.server), message)


def _graphql_http_detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}"
    if isinstance(body, dict) and body.get("errors"):
        return str(body["errors"][0].get("message") or f"HTTP {response.status_code}")[:500]
    return f"HTTP {response.status_code}"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None
