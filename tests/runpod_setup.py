"""The one way the RunPod tests set up RunPod: the module's emulator (conftest's
`runpod_server`, on the module's own KEY) as new for each test, and what talks to it: a
client of either transport, or a scheduler process with RunPod as its provider.

A test module takes the fixtures by importing them (pytest finds a fixture by the name it
was given, `runpod` and `on_runpod`, so the test functions' arguments do not shadow the
imported names):

    from tests.runpod_setup import fresh_runpod, schedulers_on_runpod  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from openalice_scheduler.providers.runpod.client import GraphQLClient, RestClient, RunPodClient
from tests.harness import Scheduler
from tests.runpod_emulator import RunPodEmulator
from tests.runpod_emulator.state import Pod

# How long a new pod takes to run, unless the module says otherwise (`PROVISION_DELAY`):
# a moment, as on RunPod, so that a driver's wait for RUNNING is exercised.
PROVISION_DELAY = 0.3


@pytest.fixture(name="runpod")
def fresh_runpod(runpod_server: RunPodEmulator, request: pytest.FixtureRequest) -> RunPodEmulator:
    """The module's RunPod emulator as new: no pods, calls, faults or switches; a new pod
    runs `PROVISION_DELAY` seconds after its create (the test module's, if it sets one)."""
    runpod_server.reset()
    runpod_server.provision_delay = getattr(request.module, "PROVISION_DELAY", PROVISION_DELAY)
    return runpod_server


def make_client(
    api: str, base_url: str, key: str, *, timeout: float = 5.0, backoff: float = 0.05
) -> RunPodClient:
    """A client of transport `api` ("rest" or "graphql") for the API at `base_url`, with a
    backoff short enough for a test's retries."""
    client_class = RestClient if api == "rest" else GraphQLClient
    return client_class(key, base_url, timeout=timeout, backoff=backoff)


def pods_of(runpod: RunPodEmulator, sched: Scheduler) -> list[Pod]:
    """The emulator's pods that `sched` made: those named for its instance."""
    return [p for p in runpod.list_pods() if p.name.startswith(f"oa-{sched.instance}-")]


@pytest.fixture(name="on_runpod")
def schedulers_on_runpod(
    make_scheduler: Callable[..., Scheduler], runpod: RunPodEmulator
) -> Callable[..., Scheduler]:
    """Start a scheduler process (conftest's `make_scheduler`: cleaned up after the test)
    whose provider is RunPod on transport `api`, pointed at the emulator with its key
    (`key` another): quick to see a pod run, a fresh look at the catalog each time. `env`
    adds to that environment or overrides it (`PROVIDERS` for more providers)."""

    def start(api: str = "rest", *, key: str | None = None, **env: str) -> Scheduler:
        settings = {
            "PROVIDERS": "runpod",
            "RUNPOD_API": api,
            "RUNPOD_API_KEY": key or runpod.api_key,
            "RUNPOD_API_BASE_URL": runpod.base_url,
            "RUNPOD_POLL_INTERVAL_SECONDS": "0.1",
            "RUNPOD_CATALOG_TTL_SECONDS": "0",
            "RUNPOD_REQUEST_TIMEOUT_SECONDS": "10",
        }
        return make_scheduler(**(settings | env))

    return start
