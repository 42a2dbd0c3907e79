"""What reconciliation reads of Redis (`SandboxStore.survey`: one script per step of a pool's members),
against the suite's real Redis: every member once, over several steps; the settled ones (ready, or
leased to a session that names them) as ids, every other with its record as Redis holds it and the
sandbox its session names, including the cases reconciliation exists for (a member whose record is
gone, a lease whose session is gone or names another sandbox)."""

from __future__ import annotations

import asyncio
import time

from sandpool.state.client import close, connect
from sandpool.state.keys import Keys
from sandpool.state.sandboxes import SURVEY_STEP, SandboxRecord, SandboxStore, Settled


def test_survey_reads_every_member_with_its_record_and_session(redis_url: str, redis_prefix: str) -> None:
    async def main() -> None:
        client = connect(redis_url, timeout=5)
        keys = Keys(redis_prefix)
        sandboxes = SandboxStore(client, keys, record_ttl_seconds=600)
        try:
            now = time.time()
            many = [f"sb-{i:04d}" for i in range(SURVEY_STEP * 2 + 17)]  # more than one step of SSCAN
            for sandbox_id in many:
                assert await sandboxes.register_starting(sandbox_id, pool="default", image="python",
                                                         ceiling=10_000, now=now, owner="replica-a")
            await client.sadd(keys.pool_members("other"), "sb-gone")  # a member whose record is gone
            await client.hset(keys.sandbox("sb-0000"), mapping={"state": "leased", "session": "s-holds"})
            await client.hset(keys.session("s-holds"), mapping={"sandbox": "sb-0000"})
            await client.hset(keys.sandbox("sb-0001"), mapping={"state": "leased", "session": "s-elsewhere"})
            await client.hset(keys.session("s-elsewhere"), mapping={"sandbox": "sb-9999"})
            await client.hset(keys.sandbox("sb-0002"), mapping={"state": "leased", "session": "s-gone"})
            await client.hset(keys.sandbox("sb-0003"), mapping={"created_at": "not a time"})
            await client.hset(keys.sandbox("sb-0004"), mapping={"state": "ready"})
            # Ready, yet naming a session (no script writes that: a restored or edited Redis): not settled.
            await client.hset(keys.sandbox("sb-0005"), mapping={"state": "ready", "session": "s-stray"})

            survey = await sandboxes.survey(["default", "other"], rest=0.5)  # paced: the same answer

            # Ready, and leased to a session that names it: settled, read as ids (and the session).
            assert survey.settled == [Settled("default", ready=["sb-0004"], held=["sb-0000"], sessions=["s-holds"]),
                                      Settled("other")]
            assert sorted(survey.records) == sorted([*set(many) - {"sb-0000", "sb-0004"}, "sb-gone"])
            assert survey.records["sb-gone"] == SandboxRecord("sb-gone", "", "other")
            starting = survey.records["sb-0010"]
            assert (starting.state, starting.pool, starting.session, starting.owner) == \
                ("starting", "default", "", "replica-a")
            assert abs(starting.created_at - now) < 0.01
            assert survey.records["sb-0001"].session == "s-elsewhere"
            assert (survey.records["sb-0005"].state, survey.records["sb-0005"].session) == ("ready", "s-stray")
            assert survey.records["sb-0003"].created_at == 0.0  # unreadable: as old as can be
            assert survey.sessions == {"s-elsewhere": "sb-9999", "s-gone": "", "s-stray": ""}
        finally:
            await close(client)

    asyncio.run(main())
