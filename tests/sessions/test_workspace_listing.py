"""Listing a workspace's sessions (`SessionStore.of_workspace`, one script per step of the workspace's set)
against the suite's real Redis: every live session once, sorted, at most `limit`, over several steps; a set
member whose session is gone or is another workspace's is never shown."""

from __future__ import annotations

import asyncio

from sandpool.state.client import close, connect
from sandpool.state.keys import Keys
from sandpool.state.sessions import LIST_STEP, SessionStore


def test_listing_reads_every_live_session_of_the_workspace_once(redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        client = connect(redis_url, timeout=5)
        keys = Keys(redis_prefix)
        store = SessionStore(client, keys)
        try:
            ids = [f"s-{i:04d}" for i in range(LIST_STEP * 2 + 9)]  # more than one step
            async with client.pipeline(transaction=False) as pipe:
                for n, session in enumerate(ids):
                    pipe.hset(keys.session(session), mapping={
                        "workspace": "w", "pool": "default", "image": "python", "created_at": "100.5",
                        "idle_timeout_seconds": "600", "limits": '{"max_processes":64}', "secret": "never shown",
                        "address": "never shown"})
                    pipe.zadd(keys.deadlines, {session: 1000 + n})
                    pipe.sadd(keys.workspace_sessions("w"), session)
                await pipe.execute()
            await client.sadd(keys.workspace_sessions("w"), "s-gone", "s-theirs")  # stale members
            await client.hset(keys.session("s-theirs"), mapping={"workspace": "other", "pool": "default"})

            listed = await store.of_workspace("w", 10_000)
            assert [h["session_id"] for h in listed] == ids
            first = listed[0]
            assert first["deadline"] == 1000.0 and first["created_at"] == 100.5 and first["pool"] == "default"
            assert first["limits"]["max_processes"] == 64 and set(first["limits"]) > {"max_processes"}
            assert "secret" not in first and "address" not in first and "workspace" not in first

            some = await store.of_workspace("w", 50)
            assert 48 <= len(some) <= 50 and {h["session_id"] for h in some} <= set(ids)
            assert [h["session_id"] for h in some] == sorted(h["session_id"] for h in some)
            assert await store.of_workspace("nobody", 10) == []
        finally:
            await close(client)

    asyncio.run(main())
