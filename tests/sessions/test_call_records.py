"""Call records, against a real Redis: the round trip that admits a call records it; its `done` meters it
and removes the record once (a `done` sent twice counts once); a record whose `done` never came (its api
crashed) is settled by the controller's reaper as an unconfirmed call, the session's deadline reset,
and a `done` that comes after that counts nothing."""

from __future__ import annotations

import asyncio
import time

from test_lease_repeats import LIMITS, publish, stores

from sandpool.controller.metrics import ControllerMetrics
from sandpool.controller.reaper import SessionReaper
from sandpool.state.keys import Keys, utc_day
from sandpool.state.sessions import CallSpec, Leased, SessionStore

EXEC = {"executions": 1, "execution_seconds": 0.25}


async def leased(store: SessionStore, sandboxes: object, session: str, workspace: str = "w") -> None:
    await publish(sandboxes, f"sb-{session}")  # type: ignore[arg-type]
    granted = await store.lease(session_id=session, workspace=workspace, pool="default", image="python",
                                now=time.time(), limits=LIMITS, workspace_limits={})
    assert isinstance(granted, Leased)


async def usage(client: object, keys: Keys, workspace: str = "w") -> dict[str, str]:
    return await client.hgetall(keys.usage_total(workspace))  # type: ignore[attr-defined, no-any-return]


def test_a_touch_records_the_call_and_done_sent_twice_counts_once(redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, store, sandboxes):
            await leased(store, sandboxes, "s1")
            call = CallSpec("c1", busy_for=40.0, tool="code_execution", grace=5.0)
            before = time.time()
            assert await store.touch(session_id="s1", workspace="w", now=before, call=call) is not None
            record = await client.hgetall(keys.call("c1"))
            assert record["session"] == "s1" and record["workspace"] == "w" and record["tool"] == "code_execution"
            assert await client.zscore(keys.call_deadlines, "c1") == before + 45.0  # busy for 40 s, then 5 s of grace
            assert abs(float(record["deadline"]) - (before + 45.0)) < 0.01
            assert await client.hget(keys.session("s1"), "inflight") == "1"

            finished = [await store.done(call_id="c1", session_id="s1", workspace="w", now=time.time(),
                                         event="execution", tool="code_execution", amounts=EXEC) for _ in range(2)]
            assert finished == [True, False], "the second done did something"
            totals = await usage(client, keys)
            assert totals["executions"] == "1" and totals["executions:code_execution"] == "1"
            assert not await client.exists(keys.call("c1")) and await client.zcard(keys.call_deadlines) == 0
            assert await client.hget(keys.session("s1"), "inflight") == "0"
            events = [e for _, e in await client.xrange(keys.usage_events) if e.get("type") == "execution"]
            assert len(events) == 1

    asyncio.run(main())


def test_an_unknown_or_foreign_session_records_nothing_and_a_foreign_done_settles_nothing(
        redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, store, sandboxes):
            await leased(store, sandboxes, "s2", workspace="owner")
            for session, workspace in (("s2", "prober"), ("no-such", "owner")):
                call = CallSpec(f"c-{workspace}-{session}", busy_for=10.0)
                assert await store.touch(session_id=session, workspace=workspace, now=time.time(), call=call) is None
                assert not await client.exists(keys.call(call.call_id))
            assert await client.zcard(keys.call_deadlines) == 0
            call = CallSpec("c-owner", busy_for=10.0, tool="code_execution")
            assert await store.touch(session_id="s2", workspace="owner", now=time.time(), call=call) is not None
            # Another workspace naming the owner's call id settles nothing and meters nothing.
            assert not await store.done(call_id="c-owner", session_id="s2", workspace="prober", now=time.time(),
                                        event="execution", tool="code_execution", amounts=EXEC)
            assert await client.exists(keys.call("c-owner"))
            assert await usage(client, keys, "prober") == {}

    asyncio.run(main())


def test_the_reaper_settles_an_overdue_call_once_as_unconfirmed_and_resets_the_session_deadline(
        redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, store, sandboxes):
            await leased(store, sandboxes, "s3")
            started = time.time()
            await store.touch(session_id="s3", workspace="w", now=started,
                              call=CallSpec("c-exec", busy_for=100.0, tool="bash_code_execution", grace=1.0))
            await store.touch(session_id="s3", workspace="w", now=started,
                              call=CallSpec("c-file", busy_for=100.0, grace=1.0))
            extended = await client.zscore(keys.deadlines, "s3")
            assert extended >= started + 100  # the touches extended the session over the calls
            reaper = SessionReaper(store, ControllerMetrics.create(), interval=1.0, batch=16)

            assert await reaper.reap_once(now=started + 50) == 0  # not overdue yet: nothing settled
            assert await client.zcard(keys.call_deadlines) == 2 and "executions" not in await usage(client, keys)

            overdue = started + 102
            assert await reaper.reap_once(now=overdue) == 0  # (no session released: it lives on)
            totals = await usage(client, keys)
            assert totals["executions"] == "1" and totals["unconfirmed_executions"] == "1"
            assert totals["executions:bash_code_execution"] == "1" and "execution_seconds" not in totals
            assert await client.zcard(keys.call_deadlines) == 0
            assert not await client.exists(keys.call("c-exec")) and not await client.exists(keys.call("c-file"))
            assert await client.hget(keys.session("s3"), "inflight") == "0"
            assert await client.zscore(keys.deadlines, "s3") == overdue + LIMITS.idle_timeout_seconds
            day = await client.hgetall(keys.usage_day("w", utc_day(overdue)))
            assert day["unconfirmed_executions"] == "1"
            counted = reaper.metrics.registry.get_sample_value
            assert counted("sandpool_unconfirmed_calls_total", {"kind": "execution"}) == 1
            assert counted("sandpool_unconfirmed_calls_total", {"kind": "file"}) == 1

            # The crashed api's done, had it come after all: nothing counted twice.
            assert not await store.done(call_id="c-exec", session_id="s3", workspace="w", now=time.time(),
                                        event="execution", tool="bash_code_execution", amounts=EXEC)
            assert (await usage(client, keys))["executions"] == "1"
            assert await reaper.reap_once(now=overdue + 1000) == 1  # the session, past its lifetime by then
            assert (await usage(client, keys))["unconfirmed_executions"] == "1"

    asyncio.run(main())
