"""Leader election for the pool controller: one Redis key with an expiry.

`SET key replica NX PX term` takes leadership for one term (`leadership_ms`); only the
holder may renew or drop it (compare-and-act scripts), so a replica that lost
leadership while paused cannot extend or delete its successor's. The holder also keeps
a local deadline: once it could not renew for a whole term it stops acting as leader
before another replica can have started, whatever Redis says later.

(Leadership has a term, never a "lease": a lease is a session's hold on a sandbox.)
"""

from __future__ import annotations

import time

from sandpool.state import scripts
from sandpool.state.client import Client
from sandpool.state.errors import translated


class Leadership:
    def __init__(self, client: Client, key: str, replica_id: str, *, leadership_ms: int) -> None:
        self.redis = client
        self.key = key
        self.replica_id = replica_id
        self.leadership_ms = leadership_ms
        self._renew = client.register_script(scripts.RENEW_LEADERSHIP)
        self._release = client.register_script(scripts.RELEASE_LEADERSHIP)
        self.valid_until = 0.0  # monotonic; leadership is trusted only before this
        self._renewal = scripts.named(replica=replica_id, leadership_ms=leadership_ms)

    @translated
    async def try_acquire(self) -> bool:
        started = time.monotonic()
        took = await self.redis.set(self.key, self.replica_id, nx=True, px=self.leadership_ms)
        if not took:
            # Our own leadership survives a restart of the loop (same replica id): keep it.
            took = bool(await self._renew(keys=[self.key], args=self._renewal))
        if took:
            self.valid_until = started + self.leadership_ms / 1000 * 0.8
        return bool(took)

    @translated
    async def renew(self) -> bool:
        started = time.monotonic()
        ok = bool(await self._renew(keys=[self.key], args=self._renewal))
        self.valid_until = started + self.leadership_ms / 1000 * 0.8 if ok else 0.0
        return ok

    def still_valid(self) -> bool:
        return time.monotonic() < self.valid_until

    @translated
    async def release(self) -> None:
        self.valid_until = 0.0
        await self._release(keys=[self.key], args=scripts.named(replica=self.replica_id))
