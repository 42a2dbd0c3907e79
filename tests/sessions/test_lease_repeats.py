"""A lease or a claim sent twice (redis-py sends a script again when the connection died before its
reply) answers what the first run did: one session, one sandbox, one `session_created`, one place in
the queue. Found by the chaos test that kills Redis under load, where the repeat leased a second
sandbox to the same session (the first leaked) or refused a waiter whose session already existed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from sandpool.state.client import close, connect
from sandpool.state.keys import Keys
from sandpool.state.sandboxes import SandboxStore
from sandpool.state.sessions import Leased, SessionLimits, SessionStore, Waiting

LIMITS = SessionLimits(idle_timeout_seconds=60, max_lifetime_seconds=600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)


async def publish(sandboxes: SandboxStore, sandbox_id: str) -> None:
    assert await sandboxes.register_starting(sandbox_id, pool="default", image="python", ceiling=8,
                                             now=time.time(), owner="test")
    assert await sandboxes.publish_ready(sandbox_id, pool="default", address=f"unix:///nowhere/{sandbox_id}",
                                         secret=f"secret-{sandbox_id}", now=time.time())


@contextlib.asynccontextmanager
async def stores(redis_url: str, prefix: str) -> AsyncIterator[tuple[Any, Keys, SessionStore, SandboxStore]]:
    client = connect(redis_url, timeout=2)
    keys = Keys(prefix)
    try:
        yield client, keys, SessionStore(client, keys), SandboxStore(client, keys, record_ttl_seconds=600)
    finally:
        await close(client)


async def session_created(client: Any, keys: Keys, session: str) -> int:
    entries = await client.xrange(keys.usage_events)
    return sum(1 for _, e in entries if e.get("type") == "session_created" and e.get("session") == session)


def test_a_lease_sent_twice_grants_one_sandbox_once(redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, store, sandboxes):
            for sandbox_id in ("sb-one", "sb-two"):
                await publish(sandboxes, sandbox_id)
            first, again = [await store.lease(session_id="s-direct", workspace="w", pool="default",
                                              image="python", now=time.time(), limits=LIMITS,
                                              workspace_limits={}) for _ in range(2)]
            assert isinstance(first, Leased) and again == first
            assert await client.llen(keys.pool_ready("default")) == 1, "the repeat leased a second sandbox"
            assert await session_created(client, keys, "s-direct") == 1
            assert await client.scard(keys.pool_leased("default")) == 1

    asyncio.run(main())


def test_a_queued_lease_and_a_claim_sent_twice_queue_once_and_claim_once(redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, store, sandboxes):
            first, again = [await store.lease(session_id="s-queued", workspace="w", pool="default",
                                              image="python", now=time.time(), limits=LIMITS,
                                              workspace_limits={}, wait_seconds=10) for _ in range(2)]
            assert isinstance(first, Waiting) and again == first
            assert await client.lrange(keys.pool_wait_queue("default", "w"), 0, -1) == ["s-queued"]
            await publish(sandboxes, "sb-promised")  # promised to the waiter at once
            claimed, claimed_again = [await store.claim(waiter="s-queued", workspace="w", pool="default",
                                                        now=time.time()) for _ in range(2)]
            assert isinstance(claimed, Leased) and claimed.sandbox == "sb-promised"
            assert claimed_again == claimed, "a repeated claim was refused though its session exists"
            assert await session_created(client, keys, "s-queued") == 1
            # Not another workspace's: the repeat is answered only to the workspace that claimed.
            assert await store.claim(waiter="s-queued", workspace="other", pool="default", now=time.time()) is None

    asyncio.run(main())
