"""Which pools an installation runs: declared once, read by the api (to lease from them) and by the
controller (to keep them warm), from the same flags and environment."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, model_validator

from sandpool.controller.provider import PoolSpec
from sandpool.core.settings import ConfigurationError, ServiceSettings

DEFAULT_POOL = "default"


class PoolSettings(ServiceSettings):
    pool_size: int = Field(default=2, ge=0, description=(
        "Warm floor of the default pool: sandboxes kept ready whatever the demand"))
    max_warm: int | None = Field(default=None, ge=0, description=(
        "Warm cap of the default pool: the most kept ready when demand asks for more (default: 4 x the floor, "
        "at least 4, within the ceiling)"))
    max_sandboxes: int = Field(default=16, ge=1, description="Ceiling of the default pool (sandboxes of any state)")
    image: str = Field(default="python", min_length=1, description="Image of the default pool")
    pools_file: Path | None = Field(default=None, description=(
        "YAML file of pools (replaces the default pool); the first pool is the default one"))

    @model_validator(mode="after")
    def _warm_within_ceiling(self) -> PoolSettings:
        if self.pool_size > self.max_sandboxes:
            raise ValueError("pool_size (the warm floor) exceeds max_sandboxes (the ceiling)")
        if self.max_warm is not None and not self.pool_size <= self.max_warm <= self.max_sandboxes:
            raise ValueError("max_warm (the warm cap) must be between pool_size and max_sandboxes")
        return self


def pools_from_settings(settings: PoolSettings) -> list[PoolSpec]:
    """The pools this installation runs: the pools file, or one default pool from the flags."""
    if settings.pools_file is not None:
        # Imported only when asked for: the loader pulls in YAML and template validation.
        from sandpool.controller.templates import load_pools

        pools = list(load_pools(settings.pools_file))
        if not pools:
            raise ConfigurationError(f"--pools-file {settings.pools_file} defines no pool")
    else:
        cap = settings.max_warm if settings.max_warm is not None else default_max_warm(settings.pool_size,
                                                                                      settings.max_sandboxes)
        pools = [PoolSpec(name=DEFAULT_POOL, image=settings.image, warm=settings.pool_size,
                          ceiling=settings.max_sandboxes, max_warm=cap)]
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ConfigurationError("pool names must be unique")
    return pools


def default_max_warm(floor: int, ceiling: int) -> int:
    """The warm cap when none is set: room for demand to grow to four times the floor (or 4)."""
    return min(ceiling, max(4 * floor, 4))
