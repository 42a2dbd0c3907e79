"""A pool controller in a process of its own, so a test can SIGKILL it like a crashed replica.

usage: python controller_process.py REDIS_URL PREFIX DATA_DIR REPLICA LEASE_MS WARM CEILING
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import redis.asyncio as aioredis

from sandpool.controller.controller import PoolController
from sandpool.controller.provider import PoolSpec
from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings
from sandpool.state.keys import Keys


async def main(url: str, prefix: str, data_dir: str, replica: str, leadership_ms: str, warm: str, ceiling: str) -> None:
    client = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=5)
    provider = LocalProvider(LocalProviderSettings(data_dir=Path(data_dir)))
    await provider.start()
    controller = PoolController(client, Keys(prefix=prefix), provider,
                                [PoolSpec(name="default", image="python", warm=int(warm), ceiling=int(ceiling))],
                                replica_id=replica, leadership_ms=int(leadership_ms))
    await controller.run()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:8]))
