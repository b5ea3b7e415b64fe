"""Warm pools: idle, ready workers kept per kind and GPU class, and how one is handed a
lease (docs/concepts/pools.md#warm-pools)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings


class PoolSettings(BaseSettings):
    """Idle, ready workers kept per kind and GPU class, how long one may stay idle, and
    the hand-off that gives one its lease."""

    warm_pool: str | None = Field(
        None,
        description="Idle, ready workers to keep per kind and GPU class, "
        "`kind/gpu=n,…` (e.g. `renderer/none=2,anim/entry=1`); unset = no pool.",
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
    def warm_pool_targets(self) -> dict[tuple[str, str], int]:
        """WARM_POOL as {(kind, gpu): idle workers to keep}."""
        return parse_warm_pool(self.warm_pool)


def parse_warm_pool(value: str | None) -> dict[tuple[str, str], int]:
    """`renderer/none=2,anim/entry=1` as {(kind, gpu): n}; ValueError naming the bad part."""
    from openalice_scheduler.models import GpuClass, WorkerKind

    kinds, gpus = [k.value for k in WorkerKind], [g.value for g in GpuClass]
    targets: dict[tuple[str, str], int] = {}
    for part in (value or "").split(","):
        if not part.strip():
            continue
        match = re.fullmatch(r"\s*([a-z]+)/([a-z]+)\s*=\s*(\d{1,4})\s*", part)
        if match is None:
            raise ValueError(f"{part.strip()[:64]!r} is not kind/gpu=count (e.g. renderer/none=2)")
        kind, gpu, count = match[1], match[2], int(match[3])
        if kind not in kinds:
            raise ValueError(
                f"unknown kind {kind!r} in {part.strip()!r}; use one of " + ", ".join(kinds)
            )
        if gpu not in gpus:
            raise ValueError(
                f"unknown GPU class {gpu!r} in {part.strip()!r}; use one of " + ", ".join(gpus)
            )
        if (kind, gpu) in targets:
            raise ValueError(f"{kind}/{gpu} is given twice")
        targets[(kind, gpu)] = count
    return targets
