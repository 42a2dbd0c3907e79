"""Behind Sentinel a lease is acknowledged by the replica before it is answered: the lease script and a
`WAIT 1` run on one connection (WAIT counts that connection's writes), as the primary's MONITOR sees
them; the replica holds the session the moment the lease returns; a lease that leased nothing waits
for no one."""

from __future__ import annotations

import asyncio
import secrets
import time

import redis
from ha_servers import SERVICE, Replicated
from testkit import monitored

from sandpool.state.client import WAIT_TIMEOUT_MS, close, connect
from sandpool.state.keys import Keys
from sandpool.state.sessions import Leased, Refused, SessionLimits, SessionStore

LIMITS = SessionLimits(idle_timeout_seconds=60, max_lifetime_seconds=600, exec_timeout_seconds=10,
                       max_exec_timeout_seconds=10)


def publish_ready(r: redis.Redis, keys: Keys) -> str:
    sandbox_id = "sb-" + secrets.token_hex(6)
    r.hset(keys.sandbox(sandbox_id), mapping={"state": "ready", "pool": "default", "image": "python",
                                              "created_at": time.time(), "owner": "ha-tests",
                                              "address": "unix:///nonexistent.sock", "secret": "unused"})
    r.sadd(keys.pool_members("default"), sandbox_id)
    r.rpush(keys.pool_ready("default"), sandbox_id)
    return sandbox_id


def test_a_lease_is_acknowledged_by_the_replica_before_it_is_answered(replicated: Replicated,
                                                                       redis_prefix: str) -> None:
    keys = Keys(redis_prefix)
    primary = redis.Redis(port=replicated.primary.port, decode_responses=True)
    replica = redis.Redis(port=replicated.replica.port, decode_responses=True)
    sandbox = publish_ready(primary, keys)
    assert replicated.primary_port() == replicated.primary.port  # the Sentinels name it: the services use it

    async def lease(session: str) -> Leased | object:
        client = connect(replicated.url, timeout=2)
        try:
            store = SessionStore(client, keys)
            await store.load_scripts()
            return await store.lease(session_id=session, workspace="acme", pool="default", image="python",
                                     now=time.time(), limits=LIMITS, workspace_limits={})
        finally:
            await close(client)

    with monitored(f"redis://127.0.0.1:{replicated.primary.port}") as commands:
        leased = asyncio.run(lease("s-first"))
        assert isinstance(leased, Leased) and leased.sandbox == sandbox
        assert replica.hget(keys.session("s-first"), "sandbox") == sandbox  # already there: acknowledged
    scripts = [(who, text) for who, text in commands if text.upper().startswith("EVALSHA")]
    waits = [(who, text) for who, text in commands if text.upper().startswith("WAIT")]
    assert len(scripts) == 1 and waits == [(scripts[0][0], f"WAIT 1 {WAIT_TIMEOUT_MS}")], commands

    with monitored(f"redis://127.0.0.1:{replicated.primary.port}") as commands:
        refused = asyncio.run(lease("s-second"))  # none ready: refused, nothing to acknowledge
        assert isinstance(refused, Refused)
    assert not [text for _, text in commands if text.upper().startswith("WAIT")], commands
    primary.close()
    replica.close()
    assert SERVICE
