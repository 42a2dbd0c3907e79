"""Which pool a CreateSession's `image` hint leases from.

The first pool is the default one: an `image` hint no pool serves is ignored
(never refused) and the handle reports the default pool's image.
"""

from __future__ import annotations

from sandpool.controller.pools import DEFAULT_POOL, default_max_warm, pools_from_settings
from sandpool.controller.provider import PoolSpec
from sandpool.core.settings import ConfigurationError

__all__ = ["DEFAULT_POOL", "PoolDirectory", "default_max_warm", "pools_from_settings"]


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
