"""A reaper call releases many sessions and writes each workspace's and pool's counters once for the call
(reap.lua's batch), against the suite's real Redis: the totals and the day's figures equal the sum of the
sessions' own usage events, to the millisecond; every release is counted in the pool's release rate;
every sandbox is doomed; the controller is nudged once; the releases are published in one message
naming every session (the api replicas end their calls); and each release is evented on its own."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

import pytest
from test_lease_repeats import stores

from sandpool.state import StateError
from sandpool.state.sandboxes import SandboxStore
from sandpool.state.sessions import Leased, SessionLimits, SessionStore, rate_bucket, utc_day

LIMITS = SessionLimits(idle_timeout_seconds=60, max_lifetime_seconds=600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)


async def drain(pubsub: Any, quiet: float = 0.3) -> list[dict[str, Any]]:
    """Every message until none came for `quiet` seconds (a subscription's confirmation is read, not kept)."""
    got = []
    while (message := await pubsub.get_message(timeout=quiet)) is not None:
        if message["type"] == "message":
            got.append(message)
    return got


async def lease_on_a_new_sandbox(sessions: SessionStore, sandboxes: SandboxStore, session: str, workspace: str,
                                 started: float, now: float, answer_grace: float = 0.0) -> None:
    """A sandbox of its own (`sb-<session>`) made ready (registered, published), then leased to `session` at
    `now` (due `answer_grace` after it, with one)."""
    sandbox = "sb-" + session
    assert await sandboxes.register_starting(sandbox, pool="default", image="python", ceiling=16, now=started,
                                             owner="test")
    assert await sandboxes.publish_ready(sandbox, pool="default", address="unix:///nowhere", secret="s",
                                         now=started)
    assert isinstance(await sessions.lease(session_id=session, workspace=workspace, pool="default", image="python",
                                           now=now, limits=LIMITS, workspace_limits={}, answer_grace=answer_grace),
                      Leased)


def test_a_reaper_call_meters_its_releases_once_per_workspace_and_pool(redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, sessions, sandboxes):
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(keys.pool_events, keys.released_sessions)
                leased: dict[str, str] = {}
                started = time.time()
                for n in range(7):
                    workspace = "w-odd" if n % 2 else "w-even"
                    await lease_on_a_new_sandbox(sessions, sandboxes, f"s-reap-{n}", workspace, started,
                                                 started + n * 0.1237)
                    leased[f"s-reap-{n}"] = workspace
                await drain(pubsub)  # the subscriptions' confirmations, the leases' own nudges

                later = started + 700  # past every session's lifetime
                examined, reaped = await sessions.reap(now=later, limit=256)
                assert examined == 7 and sorted(r.session_id for r in reaped) == sorted(leased)

                events = [e for _, e in await client.xrange(keys.usage_events) if e.get("type") == "session_released"]
                assert sorted(e["session"] for e in events) == sorted(leased)
                per_workspace: dict[str, float] = defaultdict(float)
                for event in events:
                    per_workspace[event["workspace"]] += float(event["session_seconds"])
                for workspace, seconds in per_workspace.items():
                    total = await client.hget(keys.usage_total(workspace), "session_seconds")
                    day = await client.hget(keys.usage_day(workspace, utc_day(later)), "session_seconds")
                    assert round(float(total), 3) == round(float(day), 3) == round(seconds, 3) > 0
                assert set(await client.smembers(keys.usage_workspaces)) >= {"w-odd", "w-even"}
                bucket = keys.pool_rate_prefix("default", "releases") + str(rate_bucket(later))
                assert await client.get(bucket) == "7" and 0 < await client.ttl(bucket) <= 120
                assert await client.smembers(keys.doomed) == {f"sb-s-reap-{n}" for n in range(7)}

                published: dict[str, list[str]] = defaultdict(list)
                for message in await drain(pubsub):
                    published[message["channel"]].append(message["data"])
                # One message for the call, naming each session (the apis end their calls to every one).
                assert len(published[keys.released_sessions]) == 1
                assert sorted(published[keys.released_sessions][0].split()) == sorted(leased)
                assert len(published[keys.pool_events]) == 1  # the controller is nudged once, to drain them all
            finally:
                await pubsub.aclose()

    asyncio.run(main())


def test_a_reaper_call_that_fails_part_way_meters_what_it_released(redis_url: str, redis_prefix: str) -> None:
    """Redis keeps a script's writes when it fails: the sessions released before the failing one are
    metered all the same (as they were when each release wrote its own counters)."""
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, sessions, sandboxes):
            started = time.time()
            for n in range(3):
                await lease_on_a_new_sandbox(sessions, sandboxes, f"s-part-{n}", "w-part", started, started + n)
            await client.hdel(keys.session("s-part-2"), "max_lifetime_seconds")  # the last one due cannot be judged

            with pytest.raises(StateError):
                await sessions.reap(now=started + 700, limit=256)

            events = [e for _, e in await client.xrange(keys.usage_events)
                      if e.get("type") == "session_released" and e.get("workspace") == "w-part"]
            assert sorted(e["session"] for e in events) == ["s-part-0", "s-part-1"]
            total = await client.hget(keys.usage_total("w-part"), "session_seconds")
            assert round(float(total), 3) == round(sum(float(e["session_seconds"]) for e in events), 3) > 0
            assert await client.exists(keys.session("s-part-2")) == 1  # not released: it is there to look at

    asyncio.run(main())


def test_a_direct_release_in_mode_reap_leaves_a_session_that_is_not_due(redis_url: str, redis_prefix: str) -> None:
    """The reap script reads what is due in the same script; release.lua in mode `reap` (a replica racing
    the reaper) looks at the deadline itself: a session touched meanwhile is left alone."""
    async def main() -> None:
        async with stores(redis_url, redis_prefix) as (client, keys, sessions, sandboxes):
            now = time.time()
            await lease_on_a_new_sandbox(sessions, sandboxes, "s-not-due", "w-direct", now, now)
            assert await sessions.release(session_id="s-not-due", workspace=None, now=now + 1, mode="reap") is None
            assert await client.exists(keys.session("s-not-due")) == 1
            released = await sessions.release(session_id="s-not-due", workspace=None, now=now + 700, mode="reap")
            assert released is not None and released.reason == "lifetime"

    asyncio.run(main())
