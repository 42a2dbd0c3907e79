"""A sandbox promised to a waiter whose agent dies before the waiter claims it: the waiter is queued
again and served by a fresh sandbox, the dead one is destroyed and forgotten, nothing leaks.

Against a real Redis, the real local provider and real agents, with both launchers: the zygote tells
the controller at once (`on_lost`); the plain subprocess launcher cannot, and reconciliation finds it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from testkit import eventually

from sandpool.controller.controller import PoolController
from sandpool.controller.provider import PoolSpec, ProviderError
from sandpool.providers.local import procs
from sandpool.providers.local.zygote import ZygoteError
from sandpool.state.sessions import Leased, SessionLimits, SessionStore, Waiting

LIMITS = SessionLimits(idle_timeout_seconds=300, max_lifetime_seconds=3600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)
POOL = PoolSpec(name="default", image="python", warm=0, ceiling=2)  # no warm sandbox: the caller waits


async def run_code(address: str, secret: str, session: str, code: str) -> str:
    """What `code` prints, run by the agent at `address` (its Unix socket) for `session`."""
    transport = httpx.AsyncHTTPTransport(uds=address.removeprefix("unix://"))
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox", timeout=30,
                                 headers={"Authorization": f"Bearer {secret}"}) as client:
        response = await client.post(f"/sessions/{session}/exec",
                                     json={"tool": "code_execution", "input": {"code": code}})
    assert response.status_code == 200, response.text
    return str(response.json()["result_block"]["content"]["stdout"])


@pytest.mark.parametrize("launcher", ["zygote", "subprocess"])
async def test_a_promised_sandbox_whose_agent_dies_is_replaced_for_its_waiter(launcher, redis, keys, make_provider,
                                                                              tasks):
    try:
        provider = await make_provider(launcher=launcher)
    except (ProviderError, ZygoteError) as exc:
        pytest.skip(f"no {launcher} launcher here ({exc})")
    # The subprocess launcher cannot report a death: only reconciliation (every second here) can find it.
    reconcile_seconds = 1.0 if launcher == "subprocess" else 600.0
    c = PoolController(redis, keys, provider, [POOL], replica_id="r1", leadership_ms=2000,
                       reconcile_seconds=reconcile_seconds)
    tasks.append(asyncio.create_task(c.run()))
    store = SessionStore(redis, keys)
    waiting = await store.lease(session_id="sess-w", workspace="ws", pool="default", image="python",
                                now=time.time(), limits=LIMITS, workspace_limits={}, ceiling=POOL.ceiling,
                                wait_seconds=30)
    assert isinstance(waiting, Waiting)

    async def promised() -> str:
        waiter = await redis.hgetall(keys.waiter("sess-w"))
        return waiter.get("sandbox", "") if waiter.get("state") == "promised" else ""

    doomed = await eventually(promised, timeout=30, what="a sandbox started for the waiter and promised to it")
    assert (await redis.hgetall(keys.sandbox(doomed)))["state"] == "promised"
    handle = procs.ProcessHandle.from_line((provider.root / doomed / "agent.pid").read_text())
    os.killpg(handle.pgid, signal.SIGKILL)  # the waiter has not claimed it yet

    async def promised_another() -> str:
        sandbox = await promised()
        return sandbox if sandbox and sandbox != doomed else ""

    fresh = await eventually(promised_another, timeout=30, what="the waiter queued again and promised a new sandbox")
    claimed = await store.claim(waiter="sess-w", workspace="ws", pool="default", now=time.time())
    assert isinstance(claimed, Leased) and claimed.sandbox == fresh
    assert await run_code(claimed.address, claimed.secret, "sess-w", "print(6 * 7)") == "42\n"

    async def dead_one_gone() -> bool:
        return (not (provider.root / doomed).exists() and not await redis.exists(keys.sandbox(doomed))
                and not await redis.sismember(keys.pool_members("default"), doomed)
                and not await redis.sismember(keys.doomed, doomed))

    await eventually(dead_one_gone, timeout=30, what="the dead sandbox destroyed and forgotten")
    assert not procs.is_alive(handle)
    # Nothing leaks: the provider runs what Redis knows, the one session's sandbox; no waiter is left.
    assert {s.sandbox_id for s in await provider.list()} == {fresh}
    assert await redis.smembers(keys.pool_members("default")) == {fresh}
    assert not await redis.exists(keys.waiter("sess-w"))
    assert await redis.scard(keys.pool_waiters("default")) == 0
    assert await redis.scard(keys.pool_queued("default")) == 0
    assert (await redis.hgetall(keys.sandbox(fresh)))["state"] == "leased"
    kind = "lost" if launcher == "zygote" else "stale_record"
    assert c.metrics.reconciled.labels(kind=kind)._value.get() == 1
