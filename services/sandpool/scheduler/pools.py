"""Which pools exist, and which one a CreateSession's `image` hint leases from.

The first pool is the default one: an `image` hint no pool serves is ignored
(never refused) and the handle reports the default pool's image.
"""

from __future__ import annotations

from sandpool.core.settings import ConfigurationError
from sandpool.pool.provider import PoolSpec
from sandpool.scheduler.settings import SchedulerSettings

DEFAULT_POOL = "default"


def pools_from_settings(settings: SchedulerSettings) -> list[PoolSpec]:
    """The pools this installation runs: the pools file, or one default pool from the flags."""
    if settings.pools_file is not None:
        # Imported only when asked for: the loader pulls in YAML and template validation.
        from sandpool.pool.templates import load_pools

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


class PoolDirectory:
    def __init__(self, pools: list[PoolSpec]) -> None:
        if not pools:
            raise ConfigurationError("at least one pool is required")
        self.pools = list(pools)
        self.default = self.pools[0]
        self._by_image: dict[str, PoolSpec] = {}
        for pool in self.pools:
            self._by_image.setdefault(pool.image, pool)

    def for_image(self, image: str | None) -> PoolSpec:
        if image is None:
            return self.default
        return self._by_image.get(image, self.default)
