"""RunPod API client: REST v2 (default) and GraphQL (the original driver) behind one
interface. The client owns transport, auth, retries and error decoding; the provider maps
results to leases. The API key travels only in the Authorization header: it is never put
in a URL, a log line, an exception message or a span.

This module is the one place to import from, and `build_client` picks the driver by name.
The interface, its types and the common transport are in `base.py`; each driver, with the
decoding of its answers, in `rest.py` and `graphql.py`."""

from __future__ import annotations

import httpx

from openalice_scheduler.providers.runpod.base import (
    MAX_RETRY_AFTER_S,
    ErrorKind,
    GpuStock,
    Pod,
    PodRequest,
    RunPodClient,
    RunPodError,
)
from openalice_scheduler.providers.runpod.graphql import GraphQLClient
from openalice_scheduler.providers.runpod.rest import RestClient

__all__ = [
    "MAX_RETRY_AFTER_S",
    "ErrorKind",
    "GpuStock",
    "GraphQLClient",
    "Pod",
    "PodRequest",
    "RestClient",
    "RunPodClient",
    "RunPodError",
    "build_client",
]


def build_client(
    api: str,
    api_key: str,
    base_url: str,
    *,
    timeout: float = 30.0,
    http: httpx.AsyncClient | None = None,
) -> RunPodClient:
    if api == "graphql":
        return GraphQLClient(api_key, base_url, http=http, timeout=timeout)
    return RestClient(api_key, base_url, http=http, timeout=timeout)
