"""Redis round trips on the request path, as Redis itself sees them (MONITOR).

An Execute or a file call with auth on sends Redis one script call before it reaches the agent
(admission and the session's touch together) and one after (`done`); a refused call sends one and
touches nothing, and a call to another workspace's session is still counted against the caller's rate.
A warm CreateSession sends one before its answer (admission and lease) and one after (the answer's
confirmation: sessions/answers.py).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
from testkit import monitored, wait_for

from sandpool.state import scripts
from sandpool.state.keys import Keys as RedisKeys

from .conftest import Api, Keys
from .stack import PRINT_1, Sandboxes

ANSWERED_SHA = hashlib.sha1(scripts.ANSWERED.encode()).hexdigest()
QUIET = {"PING", "INFO", "CLIENT", "HELLO"}
"""Commands of the clients' own upkeep, not of a request."""


class Sent:
    """The commands clients sent so far in a `sent` block, by name (upkeep left out)."""

    def __init__(self, seen: list[tuple[str, str]]) -> None:
        self.seen = seen

    def names(self) -> list[str]:
        return [name for name in (text.split(" ", 1)[0].upper() for _, text in list(self.seen)) if name not in QUIET]

    def answered(self) -> int:
        """How many of them ran the script confirming a CreateSession's answer (`state/lua/answered.lua`)."""
        return sum(ANSWERED_SHA in text for _, text in list(self.seen))


@contextmanager
def sent(redis_url: str) -> Iterator[Sent]:
    """What clients send while the block runs (testkit.monitored: a script's own commands are left out,
    and the window closes on a marker the monitor has seen)."""
    with monitored(redis_url) as seen:
        yield Sent(seen)


def test_an_execute_sends_one_script_call_before_the_agent_and_one_after(
        make_api: Callable[..., Api], keys: Keys, redis_url: str, sandboxes: Sandboxes) -> None:
    api = make_api()
    sandboxes.publish_agents(1)
    with api.client(keys.token("acme")) as client:
        sid = client.post("/sessions", json={}).json()["session_id"]
        assert client.post(f"/sessions/{sid}/exec", json=PRINT_1).status_code == 200  # scripts loaded, warm
        with sent(redis_url) as commands:
            answer = client.post(f"/sessions/{sid}/exec", json=PRINT_1)
            assert answer.status_code == 200 and answer.json()["result_block"]["content"]["stdout"] == "1\n"
            # `done` may trail the answer: wait for it (bounded) rather than race it.
            wait_for(lambda: len(commands.names()) >= 2, timeout=10, what="the call's done", state=commands.names)
        assert commands.names() == ["EVALSHA", "EVALSHA"]
        with sent(redis_url) as commands:
            assert client.get(f"/sessions/{sid}/files/list").status_code == 200
            wait_for(lambda: len(commands.names()) >= 2, timeout=10, what="the call's done", state=commands.names)
        assert commands.names() == ["EVALSHA", "EVALSHA"]


def test_a_refused_or_unknown_call_sends_one_script_call_and_touches_no_session(
        make_api: Callable[..., Api], keys: Keys, rdb: redis.Redis, redis_url: str, redis_prefix: str,
        sandboxes: Sandboxes) -> None:
    api = make_api(ceiling_requests_per_minute=3)
    sandboxes.publish_agents(1)
    rkeys = RedisKeys(redis_prefix)
    with api.client(keys.token("owner")) as owner:
        handle = owner.post("/sessions", json={}).json()
    sid = handle["session_id"]
    # The state before the probes is the state once the answer was confirmed (it may trail the answer).
    confirmed = handle["created_at"] + handle["idle_timeout_seconds"]
    deadline = wait_for(lambda: rdb.zscore(rkeys.deadlines, sid) == confirmed and confirmed, timeout=10,
                        what="the create's confirmation")
    with api.client(keys.token("prober")) as prober:
        with sent(redis_url) as commands:
            # Another workspace's session: the answer an unknown id gets, after one script call.
            assert prober.post(f"/sessions/{sid}/exec", json=PRINT_1).status_code == 404
        assert commands.names() == ["EVALSHA"]
        assert prober.get(f"/sessions/{sid}/files/list").status_code == 404
        assert prober.get(f"/sessions/{sid}/files/list").status_code == 404
        with sent(redis_url) as commands:
            refused = prober.get(f"/sessions/{sid}/files/list")  # the prober's fourth request of the minute
        assert refused.status_code == 429 and refused.json()["limit"] == "requests_per_minute"
        assert commands.names() == ["EVALSHA"]
    # The probes were counted, and nothing of the owner's session was extended or marked in flight.
    assert rdb.zscore(rkeys.deadlines, sid) == deadline
    assert int(rdb.hget(rkeys.session(sid), "inflight") or 0) == 0


def test_a_warm_create_session_sends_one_script_call_before_its_answer_and_sees_a_changed_policy_and_revocation(
        make_api: Callable[..., Api], keys: Keys, redis_url: str, sandboxes: Sandboxes) -> None:
    api, other_replica = make_api(), make_api()
    sandboxes.publish_agents(4)
    token = keys.token("acme", jti="acme-token-1")
    with api.client(token) as client:
        # The first CreateSession of a workspace on a replica reads its policy (admission, then the lease);
        # once the answer is sent, one more confirms it (it may trail the answer: waited for, bounded).
        with sent(redis_url) as commands:
            assert client.post("/sessions", json={}).status_code == 201
            wait_for(commands.answered, timeout=10, what="the answer's confirmation", state=commands.names)
        assert commands.names() == ["EVALSHA", "EVALSHA", "EVALSHA"] and commands.answered() == 1
        # From then on, the lease's own round trip admits it.
        with sent(redis_url) as commands:
            assert client.post("/sessions", json={}).status_code == 201
            wait_for(commands.answered, timeout=10, what="the answer's confirmation", state=commands.names)
        assert commands.names() == ["EVALSHA", "EVALSHA"] and commands.answered() == 1

        # The policy changed through another replica: the lease is computed again under it.
        with other_replica.client(keys.token("ops", admin=True)) as admin:
            assert admin.put("/v1/workspaces/acme/policy", json={"max_concurrent_sessions": 2}).status_code == 200
            with sent(redis_url) as commands:
                refused = client.post("/sessions", json={})
            assert refused.status_code == 429 and refused.json()["limit"] == "max_concurrent_sessions", refused.text
            assert commands.names() == ["EVALSHA", "EVALSHA"]
            with sent(redis_url) as commands:  # known again here: one round trip, and the same answer
                again = client.post("/sessions", json={})
            assert again.status_code == 429 and again.json()["limit"] == "max_concurrent_sessions"
            assert commands.names() == ["EVALSHA"]

            # A revocation is seen by the very next warm CreateSession.
            revocation = {"jti": "acme-token-1", "exp": int(time.time()) + 600}
            assert admin.post("/v1/revocations", json=revocation).status_code == 201
        revoked = client.post("/sessions", json={})
        assert revoked.status_code == 401 and revoked.json()["cause"] == "revoked", revoked.text
