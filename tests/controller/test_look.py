"""What each pass of the leader's loop reads first (`SandboxStore.look`, one pipelined round trip),
against the suite's real Redis: every pool's fill, and up to as many doomed sandboxes popped as it
may start destroying; none popped when it has no room."""

from __future__ import annotations

import asyncio
import time

from sandpool.state.client import close, connect
from sandpool.state.keys import Keys
from sandpool.state.sandboxes import PoolFill, SandboxStore


def test_look_reads_every_pools_fill_and_pops_what_it_has_room_for(redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        client = connect(redis_url, timeout=5)
        keys = Keys(redis_prefix)
        sandboxes = SandboxStore(client, keys, record_ttl_seconds=600)
        try:
            for n in range(3):
                assert await sandboxes.register_starting(f"sb-a{n}", pool="a", image="python", ceiling=10,
                                                         now=time.time(), owner="replica-a")
            await client.rpush(keys.pool_ready("a"), "sb-a0", "sb-a1")
            await client.sadd(keys.pool_queued("b"), "w-1")
            await client.sadd(keys.pool_waiters("b"), "w-1", "w-2")
            await client.sadd(keys.doomed, "sb-d0", "sb-d1", "sb-d2")

            look = await sandboxes.look(["a", "b"], 2)
            assert look.fills == {"a": PoolFill(ready=2, members=3), "b": PoolFill(0, 0, queued=1, waiters=2)}
            assert len(look.doomed) == 2 == look.asked and set(look.doomed) < {"sb-d0", "sb-d1", "sb-d2"}
            assert await client.scard(keys.doomed) == 1  # popped: the caller destroys them

            full = await sandboxes.look(["a"], 0)  # no room to destroy: nothing popped
            assert full.doomed == [] and full.asked == 0 and await client.scard(keys.doomed) == 1
            rest = await sandboxes.look([], 5)  # fewer than asked: the set is empty now
            assert len(rest.doomed) == 1 and rest.asked == 5 and await client.scard(keys.doomed) == 0
        finally:
            await close(client)

    asyncio.run(main())
