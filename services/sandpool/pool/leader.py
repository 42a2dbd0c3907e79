"""Leader election for the pool controller: one Redis key with an expiry.

`SET key replica NX PX lease` takes the lease; only the holder may renew or drop
it (compare-and-act Lua scripts), so a replica that lost the lease while paused
cannot extend or delete its successor's. The holder also keeps a local deadline:
once it could not renew for a whole lease period it stops acting as leader
before another replica can have started, whatever Redis says later.
"""

from __future__ import annotations

import time
from typing import Any

from sandpool.pool.scripts import Scripts


class LeaderLease:
    def __init__(self, redis: Any, key: str, replica_id: str, scripts: Scripts, *, lease_ms: int) -> None:
        self.redis = redis
        self.key = key
        self.replica_id = replica_id
        self.scripts = scripts
        self.lease_ms = lease_ms
        self.valid_until = 0.0  # monotonic; leadership is trusted only before this

    async def try_acquire(self) -> bool:
        started = time.monotonic()
        took = await self.redis.set(self.key, self.replica_id, nx=True, px=self.lease_ms)
        if not took:
            # Our own lease survives a restart of the loop (same replica id): keep it.
            took = bool(await self.scripts.renew_lease(keys=[self.key], args=[self.replica_id, self.lease_ms]))
        if took:
            self.valid_until = started + self.lease_ms / 1000 * 0.8
        return bool(took)

    async def renew(self) -> bool:
        started = time.monotonic()
        ok = bool(await self.scripts.renew_lease(keys=[self.key], args=[self.replica_id, self.lease_ms]))
        if ok:
            self.valid_until = started + self.lease_ms / 1000 * 0.8
        else:
            self.valid_until = 0.0
        return ok

    def still_valid(self) -> bool:
        return time.monotonic() < self.valid_until

    async def release(self) -> None:
        self.valid_until = 0.0
        await self.scripts.release_lease(keys=[self.key], args=[self.replica_id])
