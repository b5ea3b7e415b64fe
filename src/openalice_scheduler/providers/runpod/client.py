"""RunPod API client: REST v2 (default) and GraphQL (the original driver) behind one
interface. The client owns transport, auth, retries and error decoding; the provider maps
results to leases. The API key travels only in the Authorization header: it is never put
in a URL, a log line, an exception message or a span."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

log = logging.getLogger(__name__)

MAX_RETRY_AFTER_S = 30.0
# How RunPod words "no capacity" (REST 400 `detail`, GraphQL message): "There are no longer
# any instances available with the requested specifications. Please refresh and try
# again." and variants ("... with the request specifications. Please try again later.").
# REST answers 400 for a broken rule too; only these words tell the two apart.
_NO_CAPACITY_WORDS = ("no longer any instances available", "no instances available")


class ErrorKind(StrEnum):
    invalid = "invalid"  # 422: our body broke the contract; never retried (a bug)
    rejected = "rejected"  # 400: a rule broken or no capacity; try the next candidate
    unauthorized = "unauthorized"  # 401: bad key; provider unhealthy
    payment = "payment"  # 402: balance too low; no candidate will succeed
    forbidden = "forbidden"  # 403: no access to that pool; skip the candidate
    rate_limited = "rate_limited"  # 429 after our retries
    server = "server"  # 5xx after our retries
    timeout = "timeout"  # no answer in time (the call may have happened)
    unreachable = "unreachable"  # no connection
    not_found = "not_found"


class RunPodError(Exception):
    def __init__(self, kind: ErrorKind, detail: str, status: int | None = None, *,
                 no_capacity: bool = False) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.status = status
        # A refusal (`rejected`) for want of capacity, not for a broken rule: it may pass.
        self.no_capacity = no_capacity

    @property
    def uncertain(self) -> bool:
        """The call may have taken effect although it failed (a create may have made a pod)."""
        return self.kind in (ErrorKind.server, ErrorKind.timeout)


@dataclass(frozen=True, slots=True)
class PodRequest:
    name: str
    env: Mapping[str, str]
    ports: Sequence[str]
    image: str | None = None
    template_id: str | None = None
    gpu_type_id: str | None = None  # None: a CPU pod
    cpu_flavor: str = "cpu5c"
    vcpu_count: int = 2
    cloud: str = "SECURE"
    data_center_ids: Sequence[str] = ()
    disk_gb: int = 20


@dataclass(frozen=True, slots=True)
class Pod:
    id: str
    name: str
    status: str  # PROVISIONING, STARTING, RUNNING, EXITED, ERROR, TERMINATED
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.status == "RUNNING"

    @property
    def dead(self) -> bool:
        return self.status in ("EXITED", "ERROR", "TERMINATED")


@dataclass(frozen=True, slots=True)
class GpuStock:
    id: str
    availability: str  # NONE, LOW, MEDIUM, HIGH
    price_secure: float
    price_community: float
    data_centers: Mapping[str, str]  # data center id → availability


class RunPodClient:
    """Common transport: Bearer auth, per-call timeouts, 429 and 5xx handling."""

    api = "base"

    def __init__(
        self,
        api_key: str,
        base_url: str,
        *,
        http: httpx.AsyncClient | None = None,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
    ) -> None:
        # A burst of creates reuses its connections on the next burst (TLS at RunPod is
        # dear): keep more alive than httpx's 20, but not all 100: httpcore looks at every
        # pooled connection on each request.
        self._http = http or httpx.AsyncClient(
            base_url=base_url.rstrip("/"), timeout=timeout,
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=32),
        )
        self._auth = {"Authorization": f"Bearer {api_key}"}
        self._key = api_key
        self.retries = retries
        self.backoff = backoff

    async def close(self) -> None:
        await self._http.aclose()

    async def create_pod(self, request: PodRequest) -> Pod:
        raise NotImplementedError

    async def get_pod(self, pod_id: str) -> Pod | None:
        raise NotImplementedError

    async def list_pods(self) -> list[Pod]:
        raise NotImplementedError

    async def terminate_pod(self, pod_id: str) -> None:
        """Idempotent: a pod already gone counts as terminated."""
        raise NotImplementedError

    async def gpu_catalog(self) -> list[GpuStock] | None:
        """Stock and price per GPU type, or None where the API has no catalog."""
        return None

    async def _send(
        self, method: str, path: str, *, retry_server_errors: bool, **kwargs: Any
    ) -> httpx.Response:
        """One logical call. 429 waits `Retry-After` and repeats (nothing happened);
        5xx repeats with backoff only when `retry_server_errors` (safe to repeat)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._http.request(method, path, headers=self._auth, **kwargs)
            except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                # No connection was made: nothing was sent, so repeating is always safe.
                if attempt <= self.retries:
                    await self._sleep_backoff(attempt)
                    continue
                raise RunPodError(ErrorKind.unreachable,
                                  f"RunPod API unreachable ({type(exc).__name__})") from exc
            except httpx.TimeoutException as exc:
                if retry_server_errors and attempt <= self.retries:
                    await self._sleep_backoff(attempt)
                    continue
                raise RunPodError(ErrorKind.timeout, f"RunPod did not answer {method} in time") \
                    from exc
            except httpx.TransportError as exc:
                # A refused connection sent nothing; a broken one may have been heard.
                sent_nothing = isinstance(exc, httpx.ConnectError)
                if (sent_nothing or retry_server_errors) and attempt <= self.retries:
                    await self._sleep_backoff(attempt)
                    continue
                kind = ErrorKind.unreachable if sent_nothing else ErrorKind.timeout
                raise RunPodError(
                    kind, f"RunPod API unreachable ({type(exc).__name__})"
                ) from exc
            status = response.status_code
            if status == 429 and attempt <= self.retries:
                wait = _retry_after(response.headers.get("Retry-After"), self.backoff * attempt)
                log.info("RunPod rate limited %s %s; waiting %.1f s", method, _path(path), wait)
                await asyncio.sleep(wait)
                continue
            if status >= 500 and retry_server_errors and attempt <= self.retries:
                await self._sleep_backoff(attempt)
                continue
            return response

    async def _sleep_backoff(self, attempt: int) -> None:
        await asyncio.sleep(self.backoff * (2 ** (attempt - 1)) * (0.5 + random.random()))

    def _error(self, kind: ErrorKind, detail: str, status: int | None = None, *,
               no_capacity: bool = False) -> RunPodError:
        """An error whose text came (partly) from RunPod: the key is blanked out of it, in
        case an answer ever echoes the Authorization header back."""
        if len(self._key) >= 4:
            detail = detail.replace(self._key, "[redacted]")
        return RunPodError(kind, detail, status, no_capacity=no_capacity)


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
            "GET", "/v2/catalog/gpus", params={"include": "AVAILABILITY", "product": "POD"},
            retry_server_errors=True,
        )
        stock = []
        for gpu in self._check(response).get("gpus", []):
            price = gpu.get("price") or {}
            stock.append(GpuStock(
                id=gpu["id"],
                availability=gpu.get("availability") or "NONE",
                price_secure=float(price.get("secure") or 0.0),
                price_community=float(price.get("community") or 0.0),
                data_centers={dc["id"]: dc.get("availability", "NONE")
                              for dc in gpu.get("dataCenters") or []},
            ))
        return stock

    def _check(self, response: httpx.Response) -> Any:
        status = response.status_code
        if status < 400:
            return _json(response) if response.content else {}
        detail = _problem_detail(response)
        raise self._error(_kind_for_status(status), detail, status,
                          no_capacity=status == 400 and _says_no_capacity(detail))


class GraphQLClient(RunPodClient):
    """GraphQL at `POST /graphql`; inputs always travel as variables. RunPod answers
    HTTP 200 with an `errors` list for most failures, so those are decoded here."""

    api = "graphql"

    CREATE = (
        "mutation($input: PodFindAndDeployOnDemandInput!) { "
        "podFindAndDeployOnDemand(input: $input) { id imageName machineId desiredStatus } }"
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
        data = await self._call(self.CREATE, {"input": value}, "podFindAndDeployOnDemand",
                                retry_server_errors=False)
        pod = data["podFindAndDeployOnDemand"]
        if pod is None:
            raise RunPodError(ErrorKind.server, "RunPod returned no pod")
        return Pod(id=pod["id"], name=request.name, status="PROVISIONING")

    async def get_pod(self, pod_id: str) -> Pod | None:
        data = await self._call(self.READ, {"input": {"podId": pod_id}}, "pod",
                                retry_server_errors=True)
        pod = data.get("pod")
        if pod is None:
            return None
        return Pod(id=pod["id"], name=pod.get("name") or "", status=_graphql_status(pod))

    async def list_pods(self) -> list[Pod]:
        data = await self._call(self.LIST, {}, "myself", retry_server_errors=True)
        pods = (data.get("myself") or {}).get("pods") or []
        return [
            Pod(id=p["id"], name=p.get("name") or "", status=_graphql_status(p),
                env=_graphql_env(p.get("env")))
            for p in pods
        ]

    async def terminate_pod(self, pod_id: str) -> None:
        try:
            await self._call(self.TERMINATE, {"input": {"podId": pod_id}}, "podTerminate",
                             retry_server_errors=True)
        except RunPodError as exc:
            if exc.kind == ErrorKind.not_found:
                return
            raise

    async def _call(
        self, query: str, variables: dict[str, Any], field_name: str, *,
        retry_server_errors: bool,
    ) -> dict[str, Any]:
        attempt = 0
        while True:
            attempt += 1
            response = await self._send(
                "POST", "/graphql", json={"query": query, "variables": variables},
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
            error = self._error(found.kind, found.detail, found.status,
                                no_capacity=found.no_capacity)
            # In-band 5xx: repeat like an HTTP 5xx where that is safe.
            if error.kind == ErrorKind.server and retry_server_errors and attempt <= self.retries:
                await self._sleep_backoff(attempt)
                continue
            raise error


def build_client(api: str, api_key: str, base_url: str, *, timeout: float = 30.0,
                 http: httpx.AsyncClient | None = None) -> RunPodClient:
    if api == "graphql":
        return GraphQLClient(api_key, base_url, http=http, timeout=timeout)
    return RestClient(api_key, base_url, http=http, timeout=timeout)


# --- decoding ---------------------------------------------------------------------


def _rest_pod(item: Mapping[str, Any]) -> Pod:
    env = item.get("env") or {}
    return Pod(
        id=item["id"],
        name=item.get("name") or "",
        status=item.get("status") or "",
        env=env if isinstance(env, dict) else {},
    )


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


def _says_no_capacity(detail: str) -> bool:
    lowered = detail.lower()
    return any(words in lowered for words in _NO_CAPACITY_WORDS)


def _json(response: httpx.Response) -> Any:
    """The JSON object of a successful answer; anything else (an HTML page from a proxy on
    the way) is a server-side failure, not a crash of the caller."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise RunPodError(ErrorKind.server,
                          f"RunPod answered HTTP {response.status_code} without a JSON object",
                          response.status_code)
    return body


def _kind_for_status(status: int) -> ErrorKind:
    if status == 400:
        return ErrorKind.rejected
    if status == 401:
        return ErrorKind.unauthorized
    if status == 402:
        return ErrorKind.payment
    if status == 403:
        return ErrorKind.forbidden
    if status == 404:
        return ErrorKind.not_found
    if status == 429:
        return ErrorKind.rate_limited
    if status >= 500:
        return ErrorKind.server
    return ErrorKind.invalid


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


def _graphql_http_detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {response.status_code}"
    if isinstance(body, dict) and body.get("errors"):
        return str(body["errors"][0].get("message") or f"HTTP {response.status_code}")[:500]
    return f"HTTP {response.status_code}"


def _retry_after(value: str | None, default: float) -> float:
    try:
        seconds = float(value) if value is not None else default
    except ValueError:
        seconds = default
    return max(0.0, min(seconds, MAX_RETRY_AFTER_S))


def _path(path: str) -> str:
    return path.split("?", 1)[0]
