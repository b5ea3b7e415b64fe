"""What the RunPod tests share beside conftest's fixtures (`runpod`: the module's
emulator as new for each test; `on_runpod`: a scheduler process with RunPod as its
provider): a client of either transport, and the pods a scheduler made."""

from __future__ import annotations

from openalice_scheduler.providers.runpod.client import GraphQLClient, RestClient, RunPodClient
from tests.harness import TLS, Scheduler
from tests.runpod_emulator import RunPodEmulator
from tests.runpod_emulator.state import Pod


def make_client(
    api: str, base_url: str, key: str, *, timeout: float = 5.0, backoff: float = 0.05
) -> RunPodClient:
    """A client of transport `api` ("rest" or "graphql") for the API at `base_url`, with a
    backoff short enough for a test's retries."""
    client_class = RestClient if api == "rest" else GraphQLClient
    # With the suite's one TLS context (harness.TLS): a client of its own would load the CA
    # bundle again (~30-60 ms of CPU, for each of some 200 clients).
    return client_class(key, base_url, timeout=timeout, backoff=backoff, verify=TLS)


def pods_of(runpod: RunPodEmulator, sched: Scheduler) -> list[Pod]:
    """The emulator's pods that `sched` made: those named for its instance."""
    return [p for p in runpod.list_pods() if p.name.startswith(f"oa-{sched.instance}-")]
