"""The lease binds a sandbox's egress credential to its session, the release unbinds it: inside their own scripts.

Real Redis, the session layer's own stores: a sandbox published with its
credential's digest, leased directly or through the waiters' queue (the claim),
released by each path there is (destroy, reap, an admin, a dead sandbox).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid

import pytest

from sandpool.state.egress import EgressBinding
from sandpool.state.keys import egress_digest
from sandpool.state.sessions import KEY_EXPIRY_MARGIN_SECONDS, Leased, Waiting

from .conftest import LIMITS, Egress


async def publish(egress: Egress, *, credential: str | None, pool: str = "default") -> str:
    sandbox = f"sb-{uuid.uuid4().hex[:10]}"
    now = time.time()
    assert await egress.sandboxes.register_starting(sandbox, pool=pool, image="python", ceiling=1000, now=now,
                                                    owner="egress-tests")
    digest = egress_digest(credential) if credential else None
    assert await egress.sandboxes.publish_ready(sandbox, pool=pool, address="unix:///nowhere", secret="agent-secret",
                                                now=now, egress_digest=digest)
    return sandbox


async def lease(egress: Egress, workspace: str, allow: list[str], *, pool: str = "default",
                wait: float = 0.0) -> tuple[str, Leased | Waiting]:
    session = f"se-{uuid.uuid4().hex[:10]}"
    result = await egress.sessions.lease(session_id=session, workspace=workspace, pool=pool, image="python",
                                         now=time.time(), limits=LIMITS, workspace_limits={}, wait_seconds=wait,
                                         egress_allow=allow)
    assert isinstance(result, (Leased, Waiting)), result
    return session, result


async def test_the_lease_binds_the_credential_to_the_session_and_its_allow_list(egress: Egress) -> None:
    credential = secrets.token_urlsafe(32)
    sandbox = await publish(egress, credential=credential)
    record = await egress.store.redis.hgetall(egress.keys.sandbox(sandbox))
    assert record["egress"] == egress_digest(credential) and credential not in json.dumps(record)
    assert not await egress.store.redis.exists(egress.keys.egress_binding(credential))  # warm: bound to nothing
    session, leased = await lease(egress, "ws-a", ["pypi.org", "*.example.com:8443"])
    assert isinstance(leased, Leased) and leased.sandbox == sandbox
    key = egress.keys.egress_binding(credential)
    assert await egress.store.redis.hgetall(key) == {
        "session": session, "workspace": "ws-a", "allow": '["pypi.org","*.example.com:8443"]'}
    # it expires with the session's own keys
    assert await egress.store.redis.ttl(key) == await egress.store.redis.ttl(egress.keys.session(session))
    assert 0 < await egress.store.redis.ttl(key) <= LIMITS.max_lifetime_seconds + KEY_EXPIRY_MARGIN_SECONDS
    assert await egress.store.binding(credential) == EgressBinding(session, "ws-a", '["pypi.org","*.example.com:8443"]')


async def test_an_empty_allow_list_is_bound_too_so_a_refusal_names_the_policy(egress: Egress) -> None:
    credential = secrets.token_urlsafe(32)
    await publish(egress, credential=credential)
    session, _ = await lease(egress, "ws-none", [])
    assert await egress.store.binding(credential) == EgressBinding(session, "ws-none", "[]")


async def test_a_sandbox_without_egress_gets_no_binding_and_no_field(egress: Egress) -> None:
    sandbox = await publish(egress, credential=None)
    assert "egress" not in await egress.store.redis.hgetall(egress.keys.sandbox(sandbox))
    before = set(await egress.store.redis.keys(egress.keys.egress_binding_prefix + "*"))
    session, leased = await lease(egress, "ws-a", ["pypi.org"])
    assert isinstance(leased, Leased)
    assert set(await egress.store.redis.keys(egress.keys.egress_binding_prefix + "*")) == before
    released = await egress.sessions.release(session_id=session, workspace="ws-a", now=time.time(), mode="destroy")
    assert released is not None


async def test_a_waiter_gets_its_binding_when_it_claims_the_sandbox_started_for_it(egress: Egress) -> None:
    pool = f"p{uuid.uuid4().hex[:6]}"
    session, waiting = await lease(egress, "ws-w", ["files.example.org"], pool=pool, wait=30)
    assert isinstance(waiting, Waiting)
    credential = secrets.token_urlsafe(32)
    await publish(egress, credential=credential, pool=pool)  # promised to the waiter at once
    assert await egress.store.binding(credential) is None  # promised, not leased: still bound to nothing
    claimed = await egress.sessions.claim(waiter=session, workspace="ws-w", pool=pool, now=time.time())
    assert isinstance(claimed, Leased)
    assert await egress.store.binding(credential) == EgressBinding(session, "ws-w", '["files.example.org"]')


@pytest.mark.parametrize("mode", ["destroy", "reap", "admin", "dead"])
async def test_every_release_unbinds_the_credential(egress: Egress, mode: str) -> None:
    credential = secrets.token_urlsafe(32)
    await publish(egress, credential=credential)
    session, _ = await lease(egress, "ws-r", ["pypi.org"])
    assert await egress.store.binding(credential) is not None
    now = time.time() + (LIMITS.max_lifetime_seconds + 1 if mode == "reap" else 0)
    owner = None if mode in ("reap", "admin") else "ws-r"
    released = await egress.sessions.release(session_id=session, workspace=owner, now=now, mode=mode)
    assert released is not None
    assert not await egress.store.redis.exists(egress.keys.egress_binding(credential))


async def test_a_release_by_another_workspace_leaves_the_binding_alone(egress: Egress) -> None:
    credential = secrets.token_urlsafe(32)
    await publish(egress, credential=credential)
    session, _ = await lease(egress, "ws-owner", ["pypi.org"])
    assert await egress.sessions.release(session_id=session, workspace="ws-other", now=time.time(),
                                         mode="destroy") is None
    assert await egress.store.binding(credential) == EgressBinding(session, "ws-owner", '["pypi.org"]')
