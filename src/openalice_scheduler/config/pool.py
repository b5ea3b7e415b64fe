"""Warm pools: ready workers kept per kind, GPU class and the priority classes they serve,
fixed or following demand, and how one is handed a lease (docs/concepts/pools.md#warm-pools)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings

# One pool's bounds, after `kind/gpu[@class…]=`: `N`, or `min:A,max:B,buffer:C` (and
# `max_cost:D`, $/h) whose commas continue the entry.
_KEYS = ("min", "max", "buffer", "max_cost")
_ENTRY = re.compile(r"\s*([a-z]+)/([a-z]+)((?:@[a-z0-9_-]{1,32})*)\s*=\s*(.*?)\s*")
_KEY_VALUE = re.compile(r"\s*([a-z_]+)\s*:\s*([0-9]+(?:\.[0-9]+)?)\s*")


@dataclass(frozen=True, slots=True)
class PoolEntry:
    """One WARM_POOL entry: idle workers of `kind`/`gpu` kept at least `min` and at most
    `max` (equal: a fixed pool), `buffer` beyond the expected demand; only for callers of
    `classes` (None: any class); their idle cost at most `max_cost` $/h (None: no cap)."""

    kind: str
    gpu: str
    min: int
    max: int
    buffer: int = 0
    classes: frozenset[str] | None = None
    max_cost: float | None = None


class PoolSettings(BaseSettings):
    """Idle, ready workers kept per kind and GPU class, how long one may stay idle, and
    the hand-off that gives one its lease."""

    warm_pool: str | None = Field(
        None,
        description="Pools of idle, ready workers per kind and GPU class, comma list: "
        "`kind/gpu=N` keeps N whatever the demand; `kind/gpu=min:A,max:B,buffer:C` follows "
        "demand within A..B with C spare (optional `max_cost:D`, $/h of its idle workers); "
        "`@class` after the GPU class (repeatable) serves only callers of those priority "
        "classes (e.g. `renderer/entry@live=min:0,max:8,buffer:1,anim/none=1`); unset = "
        "no pool.",
    )
    warm_pool_scaledown_seconds: float = Field(
        300.0,
        gt=0,
        le=86_400,
        description="A pool that follows demand shrinks only after this long below its "
        "target, and one with min 0 empties after this long without an acquire.",
    )
    warm_pool_max_cost_per_hour: float | None = Field(
        None,
        ge=0,
        description="What all pools' idle and warming workers may cost together, USD per "
        "hour at their providers' prices; the pools serving the highest classes keep "
        "theirs first. Unset: no cap beyond each pool's own `max_cost`.",
    )
    warm_pool_max_idle_seconds: float = Field(
        600.0,
        gt=0,
        description="A pool worker idle this long is recycled (destroyed and "
        "replaced by a fresh one).",
    )
    warm_handoff_path: str = Field(
        "/openalice/lease",
        pattern=r"^/",
        description="Path on a pool worker that the "
        "hand-off (the lease id, expiry, kind and env) is POSTed to when it is leased.",
    )
    warm_handoff_timeout_seconds: float = Field(
        5.0,
        gt=0,
        le=300,
        description="How long a pool worker has to answer its hand-off "
        "2xx; else it is destroyed and the acquire goes cold.",
    )

    @field_validator("warm_pool")
    @classmethod
    def _warm_pool_syntax(cls, value: str | None) -> str | None:
        parse_warm_pool(value)
        return value

    @property
    def warm_pools(self) -> dict[tuple[str, str], PoolEntry]:
        """WARM_POOL as {(kind, gpu): its entry}."""
        return parse_warm_pool(self.warm_pool)


def parse_warm_pool(value: str | None) -> dict[tuple[str, str], PoolEntry]:
    """`renderer/entry@live=min:0,max:8,buffer:1,anim/none=2` as {(kind, gpu): entry};
    ValueError naming the bad part. A part `key:value` continues the entry before it."""
    entries: list[tuple[str, list[str]]] = []  # (head `kind/gpu@…=value`, continuations)
    for part in (value or "").split(","):
        if not part.strip():
            continue
        if "=" not in part and ":" in part and entries:
            entries[-1][1].append(part)
        else:
            entries.append((part, []))
    pools: dict[tuple[str, str], PoolEntry] = {}
    for head, more in entries:
        entry = _entry(head, more)
        key = (entry.kind, entry.gpu)
        if key in pools:
            raise ValueError(f"{entry.kind}/{entry.gpu} is given twice (one pool per kind/gpu)")
        pools[key] = entry
    return pools


def _entry(head: str, more: list[str]) -> PoolEntry:
    from openalice_scheduler.models import GpuClass, WorkerKind

    shown = ",".join([head, *more]).strip()[:96]
    match = _ENTRY.fullmatch(head)
    if match is None:
        raise ValueError(
            f"{shown!r} is not kind/gpu[@class…]=N or kind/gpu[@class…]=min:A,max:B,buffer:C "
            "(e.g. renderer/none=2, renderer/entry@live=min:0,max:8,buffer:1)"
        )
    kind, gpu, tags, bounds = match[1], match[2], match[3], match[4]
    kinds, gpus = [k.value for k in WorkerKind], [g.value for g in GpuClass]
    if kind not in kinds:
        raise ValueError(f"unknown kind {kind!r} in {shown!r}; use one of " + ", ".join(kinds))
    if gpu not in gpus:
        raise ValueError(f"unknown GPU class {gpu!r} in {shown!r}; use one of " + ", ".join(gpus))
    classes = frozenset(tags.split("@")[1:]) or None
    if re.fullmatch(r"\d{1,4}", bounds) and not more:
        n = int(bounds)
        return PoolEntry(kind, gpu, min=n, max=n, classes=classes)
    given: dict[str, float] = {}
    for item in [bounds, *more]:
        pair = _KEY_VALUE.fullmatch(item)
        if pair is None or pair[1] not in _KEYS:
            raise ValueError(
                f"{item.strip()[:32]!r} in {shown!r}: give a count, or min:, max:, buffer: "
                "and max_cost: with a number each"
            )
        if pair[1] in given:
            raise ValueError(f"{pair[1]} is given twice in {shown!r}")
        given[pair[1]] = float(pair[2])
    counts = {k: given.get(k, 0.0) for k in ("min", "max", "buffer")}
    if "max" not in given:
        raise ValueError(f"{shown!r} has no max: a pool that follows demand needs its ceiling")
    for name, number in counts.items():
        if number != int(number) or number > 9999:
            raise ValueError(f"{name} in {shown!r} is a whole number of workers up to 9999")
    low, high, buffer = (int(counts[k]) for k in ("min", "max", "buffer"))
    if low > high:
        raise ValueError(f"min {low} is above max {high} in {shown!r}")
    return PoolEntry(kind, gpu, low, high, buffer, classes, given.get("max_cost"))
