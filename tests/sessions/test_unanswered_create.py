"""A CreateSession whose answer was never sent leaves no sandbox leased for an idle timeout.

A lease makes its session due `answer_grace_seconds` after it; the api confirms the answer once it is
sent (`sessions.answers`), which moves the deadline to the idle timeout. An api killed between the
lease and its answer never confirms, so the session reaper releases the session at the grace, as
`unanswered` (tests/reliability/test_replicas.py kills an api for real mid-load). Against the suite's
real Redis and, for the confirmation, a real api on loopback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import redis
from sessions_harness import publish
from test_lease_repeats import stores
from test_reap_batch import LIMITS, lease_on_a_new_sandbox
from testkit import wait_for

from sandpool.sessions.answers import Answers
from sandpool.state.keys import Keys
from sandpool.state.sessions import CallSpec, SessionStore

GRACE = 5.0
PRINT_1 = {"tool": "code_execution", "input": {"code": "print(1)"}}


async def deadline_becomes(client: Any, keys: Keys, session_id: str, deadline: float, timeout: float = 2.0) -> bool:
    """Whether the session's deadline becomes `deadline` within `timeout` (a confirmation trails its answer)."""
    give_up_at = time.monotonic() + timeout
    while await client.zscore(keys.deadlines, session_id) != deadline:
        if time.monotonic() > give_up_at:
            return False
        await asyncio.sleep(0.01)
    return True


def test_an_unconfirmed_lease_is_due_at_the_grace_and_reaped_as_unanswered(redis_url: str,
                                                                          redis_prefix: str) -> None:
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, sessions, sandboxes):
            now = time.time()
            for sid in ("s-told", "s-never-told", "s-called"):
                await lease_on_a_new_sandbox(sessions, sandboxes, sid, "w", now, now, answer_grace=GRACE)
                assert await client.zscore(keys.deadlines, sid) == now + GRACE
            # A call before the confirmation extends the session over the call, and the confirmation
            # never shortens that.
            assert await sessions.touch(session_id="s-called", workspace="w", now=now + 1,
                                        call=CallSpec(call_id="c-1", busy_for=30, tool="code_execution"))
            extended = await client.zscore(keys.deadlines, "s-called")
            assert extended > now + LIMITS.idle_timeout_seconds

            assert await sessions.answered(["s-told", "s-called", "s-unknown"]) == 2
            assert await client.zscore(keys.deadlines, "s-told") == now + LIMITS.idle_timeout_seconds
            assert await client.zscore(keys.deadlines, "s-called") == extended
            assert await client.zscore(keys.deadlines, "s-unknown") is None  # nothing made for an unknown id

            examined, reaped = await sessions.reap(now + GRACE + 0.1, limit=100)
            assert examined == 1
            assert [(x.session_id, x.reason, x.sandbox) for x in reaped] == [("s-never-told", "unanswered",
                                                                              "sb-s-never-told")]
            assert await client.exists(keys.session("s-never-told")) == 0
            assert await client.hget(keys.sandbox("sb-s-never-told"), "state") == "doomed"
            assert await client.sismember(keys.doomed, "sb-s-never-told")
            assert not await client.sismember(keys.pool_leased("default"), "sb-s-never-told")
            assert await client.hget(keys.sandbox("sb-s-told"), "state") == "leased"

            # A confirmation that comes after the release finds nothing to confirm, and revives nothing.
            assert await sessions.answered(["s-never-told"]) == 0
            assert await client.zscore(keys.deadlines, "s-never-told") is None
            # Without a grace (what the state layer does unless asked) the idle timeout is the deadline.
            await lease_on_a_new_sandbox(sessions, sandboxes, "s-plain", "w", now, now)
            assert await client.zscore(keys.deadlines, "s-plain") == now + LIMITS.idle_timeout_seconds
            # Past their idle timeouts the others are reaped as idle (the call's session past the
            # extension the call gave it).
            examined, reaped = await sessions.reap(extended + 1, limit=100)
            assert {(x.session_id, x.reason) for x in reaped} == {("s-told", "idle"), ("s-called", "idle"),
                                                                  ("s-plain", "idle")}

    asyncio.run(main())


def test_the_api_confirms_what_it_answered(api, agents, r: redis.Redis, keys: Keys, redis_url: str,
                                          redis_prefix: str) -> None:
    """Served on loopback with a 1 s grace: a session created at once and one that waited for its sandbox
    (the claim goes through the same grant) are each confirmed, so a reaper pass past the grace
    releases neither, and both still answer calls."""
    app = api(answer_grace_seconds=1.0, capacity_wait_seconds=10)
    first, second = agents.start(2)
    publish(r, keys, address=first.address, secret=first.secret)
    with httpx.Client(base_url=app.url, timeout=30) as client, ThreadPoolExecutor(1) as pool:
        handles = [client.post("/sessions", json={})]
        waiting = pool.submit(client.post, "/sessions", json={})  # none ready: it waits, queued in Redis
        wait_for(lambda: r.scard(keys.pool_queued("default")) == 1, timeout=10, what="the second create queued")
        publish(r, keys, address=second.address, secret=second.secret)
        handles.append(waiting.result(30))
        assert [h.status_code for h in handles] == [201, 201], [h.text for h in handles]
        for handle in (h.json() for h in handles):
            sid = handle["session_id"]
            created_at = float(r.hget(keys.session(sid), "created_at"))
            wait_for(lambda s=sid, d=created_at + handle["idle_timeout_seconds"]: r.zscore(keys.deadlines, s) == d,
                     timeout=10, what="the answer's confirmation", state=lambda s=sid: r.zscore(keys.deadlines, s))
        time.sleep(1.2)  # past both graces

        async def reap() -> list[str]:
            async with stores(redis_url, redis_prefix) as (_, _, sessions, _):
                _, reaped = await sessions.reap(time.time(), limit=100)
                return [x.session_id for x in reaped]

        assert asyncio.run(reap()) == []
        for handle in handles:
            sid = handle.json()["session_id"]
            answer = client.post(f"/sessions/{sid}/exec", json=PRINT_1)
            assert answer.status_code == 200, answer.text
            assert answer.json()["result_block"]["content"]["stdout"] == "1\n"


def test_answers_gather_skip_what_was_called_and_confirm_the_rest_on_the_way_out(redis_url: str,
                                                                                 redis_prefix: str) -> None:
    """`Answers` as the app runs it: answers gathered for one round trip; a session called meanwhile (its
    call's touch gave it its idle timeout) is not confirmed again; `stop` confirms what still waits."""
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, sessions, sandboxes):
            answers = Answers(sessions, GRACE, gather_seconds=0.05)
            now = time.time()
            for sid in ("a-gathered", "a-called", "a-at-stop"):
                await lease_on_a_new_sandbox(sessions, sandboxes, sid, "w", now, now, answer_grace=GRACE)
            runner = asyncio.create_task(answers.run())
            await answers.answered("a-gathered")
            await answers.answered("a-called")
            answers.called("a-called")
            idle = now + LIMITS.idle_timeout_seconds
            assert await deadline_becomes(client, keys, "a-gathered", idle)
            assert await client.zscore(keys.deadlines, "a-called") == now + GRACE  # left to its call's touch
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            await answers.answered("a-at-stop")  # answered as the api stops: no gathering runs any more
            await answers.stop()
            assert await client.zscore(keys.deadlines, "a-at-stop") == idle

    asyncio.run(main())


class BuggyOnce(SessionStore):
    """A store whose first confirmation fails as a bug would (not a Redis error)."""

    failed = False

    async def answered(self, session_ids: Sequence[str]) -> int:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug in the first confirmation")
        return await super().answered(session_ids)


def test_a_confirmation_that_fails_unexpectedly_is_retried_not_the_end_of_confirming(
        redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, sessions, sandboxes):
            answers = Answers(BuggyOnce(client, keys), GRACE, gather_seconds=0.05)
            now = time.time()
            await lease_on_a_new_sandbox(sessions, sandboxes, "b-retried", "w", now, now, answer_grace=GRACE)
            runner = asyncio.create_task(answers.run())
            try:
                await answers.answered("b-retried")
                assert await deadline_becomes(client, keys, "b-retried", now + LIMITS.idle_timeout_seconds)
                assert not runner.done()
            finally:
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())
