from openalice_scheduler.providers.runpod.client import (
    ErrorKind,
    GraphQLClient,
    RestClient,
    RunPodClient,
    RunPodError,
    build_client,
)
from openalice_scheduler.providers.runpod.provider import RunPodProvider

__all__ = [
    "ErrorKind",
    "GraphQLClient",
    "RestClient",
    "RunPodClient",
    "RunPodError",
    "RunPodProvider",
    "build_client",
]
