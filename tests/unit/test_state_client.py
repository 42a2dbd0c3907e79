"""The services' Redis client across a Redis restart and a stall, against a real `redis-server`."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from testkit import RedisServer

from sandpool.state.client import close, connect
from sandpool.state.errors import StateUnavailable
from sandpool.state.keys import Keys
from sandpool.state.sessions import PoolCounts, SessionStore


@pytest.fixture
def own_redis(tmp_path: Path):
    """A server of this test's own: restarting or stopping it must not touch the suite's."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)
    server.stop()


def test_every_pooled_connection_survives_a_redis_restart(own_redis: RedisServer) -> None:
    """After a restart every pooled connection is dead; each caller's first command must still be
    answered (sent again on a fresh connection), not turned into a 503 per stale connection."""

    async def main() -> tuple[list[object], list[PoolCounts]]:
        client = connect(own_redis.url, timeout=2)
        store = SessionStore(client, Keys("restart"))
        try:
            # Eight commands at once leave eight connections in the pool.
            await asyncio.gather(*(store.ping() for _ in range(8)))
            assert len(client.connection_pool._available_connections) >= 8  # type: ignore[attr-defined]
            own_redis.stop()
            own_redis.start()
            # Plain commands and scripts (EVALSHA; the restart also forgot every loaded script).
            handles = await asyncio.gather(*(store.handle(f"s{i}", workspace=None) for i in range(8)))
            counts = await asyncio.gather(*(store.pool_counts("default") for _ in range(8)))
            return list(handles), list(counts)
        finally:
            await close(client)

    handles, counts = asyncio.run(main())
    assert handles == [None] * 8
    assert counts == [PoolCounts(0, 0, 0, 0)] * 8


def test_a_stalled_redis_is_still_unavailable_not_retried_forever(own_redis: RedisServer) -> None:
    """Only a failed connection is retried: a Redis that accepts but never answers (SIGSTOP) is a
    `StateUnavailable` after the command timeout, as before."""

    async def main() -> None:
        client = connect(own_redis.url, timeout=0.5)
        store = SessionStore(client, Keys("stall"))
        try:
            assert await store.ping()
            assert own_redis.proc is not None
            own_redis.proc.send_signal(signal.SIGSTOP)
            with pytest.raises(StateUnavailable):
                await store.handle("s", workspace=None)
        finally:
            assert own_redis.proc is not None
            own_redis.proc.send_signal(signal.SIGCONT)
            await close(client)

    asyncio.run(main())
