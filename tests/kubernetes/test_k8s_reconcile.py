"""The real pool controller, with Redis, keeping a pool warm through the provider against a real API server.

Reconciliation against what the API server really holds: orphans a crashed
predecessor left are destroyed, a leased pod deleted out of band releases its
session, a warm pod whose container died is replaced, and at the end every pod
the API server holds is a sandbox Redis knows (nothing leaks either way).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from kubelet import StandInKubelet
from realapi import RealCluster
from testkit import eventually

from sandpool.controller.controller import PoolController
from sandpool.controller.provider import PoolSpec
from sandpool.state.keys import Keys
from sandpool.state.sessions import Leased, SessionLimits, SessionStore

WARM = 3
POOL = PoolSpec(name="default", image="python", warm=WARM, ceiling=2 * WARM)
LIMITS = SessionLimits(idle_timeout_seconds=300, max_lifetime_seconds=3600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Any]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
    yield client
    await client.aclose()


async def test_reconciliation_against_the_real_api_server(
        redis: Any, redis_prefix: str, make_provider: Any, cluster: RealCluster, namespace: str,
        kubelet: StandInKubelet) -> None:
    keys = Keys(prefix=redis_prefix)
    provider = await make_provider()
    # A crashed predecessor's sandbox: running, labelled as ours, unknown to Redis.
    predecessor = await make_provider()
    await predecessor.create(POOL, "sb-orphan")
    await predecessor.close()

    controller = PoolController(redis, keys, provider, [POOL], replica_id="k8s-real", tick_seconds=0.05,
                                leadership_ms=2000, reconcile_seconds=0.5)
    task = asyncio.create_task(controller.run())
    store = SessionStore(redis, keys)

    def live() -> dict[str, dict[str, Any]]:
        return {p["metadata"]["labels"]["sandpool.dev/sandbox"]: p for p in cluster.pods(namespace)
                if not p["metadata"].get("deletionTimestamp")}

    async def members() -> set[str]:
        return set(await redis.smembers(keys.pool_members("default")))

    async def state() -> dict[str, Any]:
        return {"ready": await redis.llen(keys.pool_ready("default")), "members": sorted(await members()),
                "live": sorted(live()), "provider": provider.describe()["sandboxes"]}

    async def warm_and_agreed() -> bool:
        return (await redis.llen(keys.pool_ready("default")) == WARM and set(live()) == await members())

    try:
        await eventually(warm_and_agreed, what="a warm pool that matches the API server", state=state)
        assert "sb-orphan" not in live()  # the orphan was destroyed by reconciliation

        leased = await store.lease(session_id="s1", workspace="ws", pool="default", image="python",
                                   now=time.time(), limits=LIMITS, workspace_limits={})
        assert isinstance(leased, Leased)
        sandbox = await redis.hget(keys.session("s1"), "sandbox")
        cluster.delete_pod(namespace, f"test-{sandbox}", grace_seconds=0)  # its node went away

        async def released() -> bool:
            return not await redis.exists(keys.session("s1")) and sandbox not in await members()

        await eventually(released, what="the lost sandbox's session released and its record forgotten", state=state)

        warm_one = await redis.lindex(keys.pool_ready("default"), 0)
        kubelet.kill_container(f"test-{warm_one}")  # the agent crashed: the pod is Failed

        async def replaced() -> bool:
            return warm_one not in await members() and await warm_and_agreed()

        await eventually(replaced, what="the dead warm sandbox replaced", state=state)
    finally:
        # Cancel until it stops: on Python 3.11 one cancel racing a completed wait can be lost.
        for _ in range(100):
            task.cancel()
            await asyncio.wait({task}, timeout=0.1)
            if task.done():
                break
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert set(live()) == await members()  # nothing leaked, nothing forgotten
