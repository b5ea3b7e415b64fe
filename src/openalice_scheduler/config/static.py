"""The static provider: endpoints that already run (docs/backends/static.md)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings


class StaticSettings(BaseSettings):
    """A fixed pool of worker endpoints that already run, each leased to one caller at a
    time, probed in rotation."""

    static_workers: str | None = Field(
        None,
        description="kind[:gpu]=url,url;... endpoints leased exclusively "
        "(`renderer=http://a:8080,http://b:8080;anim=http://c:9000`).",
    )
    static_region: str | None = Field(None, description="The region the static pool is in.")
    static_price_per_hour: str = Field(
        "0",
        description="What a static endpoint's lease costs, USD per hour, as "
        "LOCAL_DOCKER_PRICE_PER_HOUR.",
    )
    static_probe_interval_seconds: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="How often each static endpoint is probed (RENDERER_READY_PATH, else "
        "a TCP connect); one that fails 3 times in a row is out of rotation (its lease, "
        "if any, ends `lost`) until it passes again; 0 = never probed, always in rotation.",
    )
