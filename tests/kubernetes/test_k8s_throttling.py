"""The real pool controller (Redis, leases, releases) driving the Kubernetes provider at the stand-in, which throttles.

Target: with a pool of 50 warm, a burst of 50 leases (so 50 creates) and then 50
releases (50 destroys) passes without the API server throttling anyone: the
provider's token buckets keep writes under the server's own limit, and
destroys leave in batches. The second test removes the provider's limit and
shows the same server does throttle that burst, so the first test can fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from apiserver import StandInApiServer
from testkit import eventually

from sandpool.controller.controller import PoolController
from sandpool.controller.provider import PoolSpec
from sandpool.state.keys import Keys
from sandpool.state.sessions import Leased, SessionLimits, SessionStore

NS = "sandboxes"
WARM = 50
LIMITS = SessionLimits(idle_timeout_seconds=300, max_lifetime_seconds=3600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)
# What the stand-in API server accepts before it answers 429 (writes: POST and DELETE).
SERVER_WRITES_PER_SECOND = 60
# What the provider is configured to send: two writes (Pod, Secret) per create, plus deletes.
# 2 * (15 + 15 t) + (5 + 5 t) = 35 + 35 t stays under 60 + 60 t for every window t, with room
# for requests that queue on the client's threads and arrive bunched (up to ~0.7 s late).
PROVIDER_LIMITS = dict(kube_create_rate=15, kube_create_burst=15, kube_delete_rate=5, kube_delete_burst=5)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Any]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
    yield client
    await client.aclose()


async def burst(redis: Any, keys: Keys, provider: Any, standin: StandInApiServer) -> None:
    """Fill 50, lease all 50, wait for 50 replacements, release all 50, wait for 50 pods again."""
    pool = PoolSpec(name="default", image="python", warm=WARM, ceiling=2 * WARM)
    controller = PoolController(redis, keys, provider, [pool], replica_id="k8s", tick_seconds=0.1,
                                leadership_ms=2000, max_concurrent_starts=WARM, max_concurrent_destroys=WARM)
    task = asyncio.create_task(controller.run())
    store = SessionStore(redis, keys)

    async def ready(n: int) -> bool:
        # At least: the controller may overshoot its warm target by a few (a race of its own,
        # between reading the ready count and counting its in-flight starts).
        return await redis.llen(keys.pool_ready("default")) >= n

    def live_pods() -> int:
        return sum(1 for p in standin.pods(NS) if not p["metadata"].get("deletionTimestamp"))

    async def state() -> dict[str, Any]:
        return {"ready": await redis.llen(keys.pool_ready("default")), "pods": len(standin.pods(NS)),
                "live": live_pods(), "doomed": await redis.scard(keys.doomed),
                "members": await redis.scard(keys.pool_members("default")),
                "starting": len(controller._starting), "destroying": len(controller._destroying),
                "provider": provider.describe(), "requests": dict(standin.requests)}

    try:
        # Generous waits (they end as soon as the condition holds): a loaded CI machine slows the
        # stand-in API server, and the controller then retries its failed creates.
        await eventually(lambda: ready(WARM), timeout=90, what="50 warm sandboxes", state=state)
        sessions = []
        for i in range(WARM):
            leased = await store.lease(session_id=f"s{i}", workspace="ws", pool="default", image="python",
                                       now=time.time(), limits=LIMITS, workspace_limits={})
            assert isinstance(leased, Leased)
            sessions.append(leased)
        await eventually(lambda: ready(WARM), timeout=90, what="50 replacements after 50 leases", state=state)
        for i in range(WARM):
            assert await store.release(session_id=f"s{i}", workspace="ws", now=time.time(), mode="destroy")

        async def settled() -> bool:
            # Every released sandbox's pod is gone: the pods left are exactly the warm ones.
            return (await ready(WARM) and await redis.scard(keys.doomed) == 0
                    and live_pods() == await redis.llen(keys.pool_ready("default")))

        await eventually(settled, timeout=90, what="50 released sandboxes destroyed, 50 warm left",
                         state=state)
    finally:
        await stop_controller(task)


async def stop_controller(task: asyncio.Task[None]) -> None:
    """Cancel the controller until it stops.

    On Python 3.11, `asyncio.wait_for` can swallow a cancellation that arrives as its
    inner wait completes (the controller's tick wait, woken by a release's nudge); one
    cancel is then not always enough. Cancel its tasks again until they are all done.
    """
    for _ in range(200):
        leftovers = [t for t in asyncio.all_tasks() if t.get_name().startswith("pool-controller")]
        if task.done() and not leftovers:
            break
        task.cancel()
        for leftover in leftovers:
            leftover.cancel()
        await asyncio.wait({task, *leftovers}, timeout=0.1)
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_fifty_warm_through_a_burst_without_throttling(
        redis: Any, redis_prefix: str, make_standin_provider: Any, standin: StandInApiServer) -> None:
    standin.throttle_writes(SERVER_WRITES_PER_SECOND, SERVER_WRITES_PER_SECOND)
    provider = await make_standin_provider(**PROVIDER_LIMITS)
    await burst(redis, Keys(prefix=redis_prefix), provider, standin)
    assert standin.status_count(429) == 0
    assert provider.describe()["api"]["throttled"] == 0
    assert standin.count("create", "pods") >= 2 * WARM
    # 50 destroys left in batches: far fewer delete calls than sandboxes.
    delete_calls = standin.count("deletecollection", "pods") + standin.count("delete", "pods")
    assert delete_calls < WARM // 2
    assert provider.counts["destroyed"] == WARM


async def test_without_the_rate_limiter_the_same_burst_is_throttled_and_still_recovers(
        redis: Any, redis_prefix: str, make_standin_provider: Any, standin: StandInApiServer) -> None:
    # A small burst allowance: the 100 writes of 50 concurrent starts overrun it however slowly a
    # loaded machine sends them (the refill rate alone would not guarantee a 429).
    standin.throttle_writes(SERVER_WRITES_PER_SECOND / 2, 5)
    provider = await make_standin_provider(kube_create_rate=1000, kube_create_burst=WARM, kube_delete_rate=1000,
                                   kube_delete_burst=WARM, kube_max_retries=8)
    await burst(redis, Keys(prefix=redis_prefix), provider, standin)
    assert standin.status_count(429) > 0  # the server did push back ...
    assert provider.describe()["api"]["throttled"] == standin.status_count(429)  # ... and every 429 was retried
