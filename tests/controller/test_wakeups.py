"""What wakes the leader: events and its own deadlines, never a tick. The safety-net wake is set far
beyond each test here, so whatever the leader does below, an event or a deadline made it do."""

from __future__ import annotations

import asyncio
import sys
import time

from testkit import eventually

from sandpool.controller.controller import PoolController
from sandpool.controller.provider import PoolSpec
from sandpool.state.sessions import Leased, SessionLimits, SessionStore

LIMITS = SessionLimits(idle_timeout_seconds=300, max_lifetime_seconds=3600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)
NEVER = 600.0  # the safety net, out of reach of every test


def controller(redis, keys, provider, spec: PoolSpec, **timing) -> PoolController:
    return PoolController(redis, keys, provider, [spec], replica_id="r1", leadership_ms=2000,
                          safety_wake_seconds=NEVER, **timing)


async def ready_count(redis, keys) -> int:
    return int(await redis.llen(keys.pool_ready("default")))


async def test_an_idle_leader_makes_no_pass_until_something_happens(redis, keys, provider, tasks):
    c = controller(redis, keys, provider, PoolSpec(name="default", image="python", warm=1, ceiling=3))
    tasks.append(asyncio.create_task(c.run()))

    async def warm() -> bool:
        return await ready_count(redis, keys) == 1

    await eventually(warm, what="the warm sandbox ready")
    await asyncio.sleep(0.2)  # the passes its start's end set off
    idle = c.ticks
    await asyncio.sleep(1.5)  # fifteen passes of the former 100 ms tick
    assert c.ticks == idle

    store = SessionStore(redis, keys)
    leased = await store.lease(session_id="s1", workspace="ws", pool="default", image="python", now=time.time(),
                               limits=LIMITS, workspace_limits={})
    assert isinstance(leased, Leased)

    async def refilled() -> bool:
        return await ready_count(redis, keys) == 1 and c.ticks > idle

    await eventually(refilled, what="the lease's nudge waking the leader to refill")


async def test_a_failed_create_is_retried_when_its_backoff_ends(redis, keys, make_provider, tasks):
    provider = await make_provider(launcher="subprocess", agent_python="/nonexistent/python")
    c = controller(redis, keys, provider, PoolSpec(name="default", image="python", warm=1, ceiling=2),
                   retry_base_seconds=0.05, retry_max_seconds=0.2)
    tasks.append(asyncio.create_task(c.run()))
    errors = c.metrics.provider_errors.labels(provider="local", operation="create")

    async def retried() -> bool:
        return errors._value.get() >= 4

    await eventually(retried, what="failed creates retried at each backoff's end")
    provider.launcher.python = sys.executable  # the provider heals

    async def warm() -> bool:
        return await ready_count(redis, keys) == 1

    await eventually(warm, what="the pool filled at the next backoff's end")


async def test_a_target_raised_by_demand_comes_back_down_with_nothing_else_happening(redis, keys, provider, tasks):
    """The lease rate is taken over one 10-second bucket here: once it turns over, the rate is 0 and the
    target comes down one sandbox per shrink period, with no lease or release to wake the leader."""
    spec = PoolSpec(name="default", image="python", warm=1, max_warm=3, ceiling=6)
    c = controller(redis, keys, provider, spec, demand_window_buckets=1, demand_headroom=1000.0,
                   demand_shrink_seconds=0.2)
    tasks.append(asyncio.create_task(c.run()))
    target = c.targets["default"]

    async def warm() -> bool:
        return await ready_count(redis, keys) == 1

    await eventually(warm, what="the warm sandbox ready")
    if time.time() % 10 > 5:  # lease early in a bucket, so the leader reads the rate before it turns over
        await asyncio.sleep(10.05 - time.time() % 10)
    store = SessionStore(redis, keys)
    leased = await store.lease(session_id="s1", workspace="ws", pool="default", image="python", now=time.time(),
                               limits=LIMITS, workspace_limits={})
    assert isinstance(leased, Leased)
    assert await store.release(session_id="s1", workspace="ws", now=time.time(), mode="destroy") is not None

    async def raised() -> bool:
        return target.target == 3 and await ready_count(redis, keys) == 3

    await eventually(raised, what="the target raised to the cap by the lease, and the pool filled to it")

    async def back_down() -> bool:
        return target.target == 1 and await ready_count(redis, keys) == 1

    await eventually(back_down, what="the target and the pool back at the floor once the rate turned over")


async def test_a_slot_a_reconciliation_frees_is_filled_at_once(redis, keys, provider, tasks):
    """A record of a sandbox the provider does not run holds a slot under the ceiling: the refill a lease
    asks for cannot start until reconciliation forgets it, and then starts without waiting for a deadline."""
    c = controller(redis, keys, provider, PoolSpec(name="default", image="python", warm=1, ceiling=2),
                   reconcile_seconds=NEVER)  # the test's own call is the only reconciliation after takeover
    tasks.append(asyncio.create_task(c.run()))

    async def warm() -> bool:
        return await ready_count(redis, keys) == 1

    await eventually(warm, what="the warm sandbox ready")
    await redis.hset(keys.sandbox("sb-ghost"), mapping={"state": "ready", "pool": "default", "image": "python",
                                                         "created_at": f"{time.time():.3f}", "owner": "r1"})
    await redis.sadd(keys.pool_members("default"), "sb-ghost")
    store = SessionStore(redis, keys)
    passes = c.ticks
    leased = await store.lease(session_id="s1", workspace="ws", pool="default", image="python", now=time.time(),
                               limits=LIMITS, workspace_limits={})
    assert isinstance(leased, Leased)

    async def settled() -> bool:  # the lease's nudge, then demand followed a second later: no deadline left
        return c.ticks >= passes + 2

    await eventually(settled, what="the lease's nudge and demand followed after it")
    assert await redis.scard(keys.pool_members("default")) == 2  # at the ceiling: no refill could start
    await c.reconcile()
    await eventually(warm, what="the refill started once the ghost's slot was freed")
    assert not await redis.sismember(keys.pool_members("default"), "sb-ghost")
