"""A RunPod API emulator (REST v2 + GraphQL) on loopback, for the RunPod provider's tests.

    with RunPodEmulator(api_key="k") as runpod:
        runpod.fail_next(503, op="create")
        ...  # point the driver at runpod.base_url

See README.md beside this file for the switches and what is (not) reproduced.
"""

from .server import DEFAULT_API_KEY, RunPodEmulator
from .state import (
    NO_CAPACITY_MESSAGE,
    OPERATION_KINDS,
    Call,
    EmulatorState,
    Fault,
    PlacementError,
)

__all__ = [
    "DEFAULT_API_KEY",
    "NO_CAPACITY_MESSAGE",
    "OPERATION_KINDS",
    "Call",
    "EmulatorState",
    "Fault",
    "PlacementError",
    "RunPodEmulator",
]
