"""Priority classes read from the settings (docs/concepts/priorities.md#priorities-and-preemption):
PRIORITY_CLASSES (`live=100:preempts,default=50,anim=10:preemptible`) and
OWNER_PRIORITY_CLASSES (`live-control=live,anim=anim`). What a class is allowed to do
(jump the line, displace another lease) is the core's (lifecycle/)."""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_CLASS = "default"
_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_FLAGS = ("preempts", "preemptible")


@dataclass(frozen=True, slots=True)
class PriorityClass:
    """`value`: higher is served first; `preempts`: its acquires may displace a lease of
    a lower, `preemptible` class when nothing is free."""

    name: str
    value: int
    preempts: bool = False
    preemptible: bool = False


def parse_priority_classes(value: str | None) -> dict[str, PriorityClass]:
    """The classes by name; unset: one class `default`, which neither preempts nor is
    preemptible (every caller as before). A set value must name `default`, the class of
    every caller who names none and whose owner has none. ValueError naming the bad
    part."""
    if not (value or "").strip():
        return {DEFAULT_CLASS: PriorityClass(DEFAULT_CLASS, 0)}
    found: dict[str, PriorityClass] = {}
    for part in filter(None, (p.strip() for p in (value or "").split(","))):
        head, *flags = part.split(":")
        name, sep, number = head.partition("=")
        name, number = name.strip(), number.strip()
        if not sep or not _NAME.fullmatch(name) or not re.fullmatch(r"-?\d{1,9}", number):
            raise ValueError(
                f"{part[:64]!r} is not name=value[:preempts][:preemptible] "
                "(e.g. live=100:preempts; a name of a-z, 0-9, - and _, a whole number)"
            )
        if name in found:
            raise ValueError(f"class {name!r} is given twice")
        flags = [f.strip() for f in flags]
        wrong = [f for f in flags if f not in _FLAGS] + [
            f for f in set(flags) if flags.count(f) > 1
        ]
        if wrong:
            raise ValueError(
                f"{part[:64]!r}: {wrong[0][:32]!r} is not a flag; flags are preempts and "
                "preemptible, once each"
            )
        found[name] = PriorityClass(name, int(number), "preempts" in flags, "preemptible" in flags)
    if DEFAULT_CLASS not in found:
        raise ValueError(
            f"no class {DEFAULT_CLASS!r}: it is the class of a caller who names none "
            "(e.g. add default=50)"
        )
    return found


def parse_owner_classes(value: str | None, classes: dict[str, PriorityClass]) -> dict[str, str]:
    """`owner=class,...` as {owner: class}; each class must be one of `classes`.
    ValueError naming the bad part."""
    found: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (value or "").split(","))):
        owner, sep, name = (x.strip() for x in part.partition("="))
        if not sep or not re.fullmatch(r"[\x21-\x7e]{1,128}", owner) or "=" in name:
            raise ValueError(f"{part[:64]!r} is not owner=class (e.g. live-control=live)")
        if name not in classes:
            raise ValueError(
                f"{part[:64]!r}: no class {name[:32]!r} in PRIORITY_CLASSES; the classes "
                f"are {', '.join(sorted(classes))}"
            )
        if owner in found:
            raise ValueError(f"owner {owner!r} is given twice")
        found[owner] = name
    return found
