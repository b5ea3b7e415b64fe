"""The kubelet's node-pressure eviction message, in the words of kubernetes/kubernetes
pkg/kubelet/eviction/helpers.go (`evictionMessage`):

    The node was low on resource: memory. Threshold quantity: 100Mi, available: 50Mi.
    Container worker was using 1044Ki, request is 0, has larger consumption of memory.

(one line, each sentence ending in ". "). The threshold is the kubelet's default hard
threshold `memory.available<100Mi`
(https://kubernetes.io/docs/concepts/scheduling-eviction/node-pressure-eviction/#hard-eviction-thresholds);
the node's observed `available` is below it (the emulator says half of it); the
container's usage is its real memory working set, named when it exceeds its memory
request. Quantities are written as `resource.Quantity.String()` writes them.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

from .scheduling import quantity

NODE_LOW = "The node was low on resource: {}. "
THRESHOLD_MET = "Threshold quantity: {}, available: {}. "
CONTAINER = "Container {} was using {}, request is {}, has larger consumption of {}. "
# The kubelet's default hard eviction threshold for memory (memory.available<100Mi).
MEMORY_THRESHOLD = 100 * 2**20
RESOURCES = ("memory",)

_BINARY = ["", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei"]
_DECIMAL = ["", "k", "M", "G", "T", "P", "E"]


def binary_si(value: int) -> str:
    """`resource.NewQuantity(value, resource.BinarySI).String()`: the largest power of
    1024 that divides it (below 1024, or not a whole multiple: the plain number)."""
    if -1024 < value < 1024:
        return str(value)
    exponent = 0
    while value % 1024 == 0 and exponent < len(_BINARY) - 1:
        value //= 1024
        exponent += 1
    return f"{value}{_BINARY[exponent]}"


def canonical(text: str | None) -> str:
    """A quantity from a pod spec as `Quantity.String()` writes it back: binary suffixes
    stay binary, decimal ones (and none) decimal; "0" when unset."""
    if text is None:
        return "0"
    found = re.match(r"^[+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?([a-zA-Z]*)$", str(text).strip())
    suffix = found[1] if found else ""
    amount = quantity(text)
    if suffix.endswith("i"):
        return binary_si(int(amount)) if amount == int(amount) else str(text)
    if amount != int(amount):
        milli = amount * 1000
        return f"{int(milli)}m" if milli == int(milli) else str(text)
    number, exponent = int(amount), 0
    while number != 0 and number % 1000 == 0 and exponent < len(_DECIMAL) - 1:
        number //= 1000
        exponent += 1
    return f"{number}{_DECIMAL[exponent]}"


def message(resource: str, pod: dict[str, Any], working_set: int | None) -> str:
    """What the kubelet writes into the evicted pod's `status.message` (and the
    DisruptionTarget condition's message)."""
    text = NODE_LOW.format(resource) + THRESHOLD_MET.format(
        binary_si(MEMORY_THRESHOLD), binary_si(MEMORY_THRESHOLD // 2)
    )
    if working_set is None:
        return text  # no stats of the container: the message names none
    container = pod["spec"]["containers"][0]
    request = ((container.get("resources") or {}).get("requests") or {}).get(resource)
    wanted = quantity(request) if request is not None else Decimal(0)
    if working_set > wanted:
        text += CONTAINER.format(
            container["name"], binary_si(working_set), canonical(request), resource
        )
    return text
