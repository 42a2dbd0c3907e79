"""The api killed between a call's answer and its `done` loses no call and counts none twice.

`sandpool up` on the suite's Redis: a session holds interpreter state; an Execute is answered while
Redis holds writes (`CLIENT PAUSE ... WRITE`), so the call's `done`, which runs after the answer is
sent, waits; the api is killed with SIGKILL then, and Redis let go. The call's record, written by the
round trip that admitted it, outlives the api: once its deadline passes the controller meters it as
an unconfirmed execution and resets the session's deadline; the session answers on, from the same
interpreter, through the api `up` started again.
"""

from __future__ import annotations

import os
import signal
import threading

import httpx
import redis
from test_restarts import _answers_again, _child, _run
from testkit import wait_for
from up_harness import Up

from sandpool.state.keys import Keys

GRACE = {"SANDPOOL_EXEC_GRACE_SECONDS": "1", "SANDPOOL_CALL_RECORD_GRACE_SECONDS": "1"}
"""A record's deadline is its Execute's timeout plus these: the test waits seconds, not a minute."""


def test_an_api_killed_between_the_answer_and_done_loses_no_call_and_counts_none_twice(
        up_factory, redis_url: str, redis_prefix: str) -> None:
    up: Up = up_factory("--redis-url", redis_url, "--redis-prefix", redis_prefix, env=GRACE)
    url, token = up.printed("SANDPOOL_URL="), up.printed("SANDPOOL_TOKEN=")
    keys = Keys(redis_prefix)
    rdb = redis.Redis.from_url(redis_url, decode_responses=True)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        session = client.post("/sessions", json={}).json()["session_id"]
        _run(client, session, "x = 42")
        workspace = rdb.hget(keys.session(session), "workspace")
        wait_for(lambda: rdb.hget(keys.usage_total(workspace), "executions") == "1", timeout=10,
                 what="the first call metered")
        api = _child(up, "api")

        answered: list[httpx.Response] = []
        running = threading.Thread(target=lambda: answered.append(client.post(f"/sessions/{session}/exec", json={
            "tool": "code_execution", "input": {"code": "import time; time.sleep(1); print(x)"},
            "timeout_seconds": 3})))
        running.start()
        # Once admitted (the round trip that records the call is a write), Redis holds every write.
        wait_for(lambda: rdb.zcard(keys.call_deadlines) == 1, timeout=10, what="the call recorded")
        rdb.execute_command("CLIENT", "PAUSE", 30_000, "WRITE")
        try:
            running.join(20)
            assert answered and answered[0].status_code == 200, answered
            assert answered[0].json()["result_block"]["content"]["stdout"] == "42\n"
            os.kill(api, signal.SIGKILL)  # its done is still waiting on Redis
            wait_for(lambda: not os.path.exists(f"/proc/{api}"), timeout=10, what="the api gone")
        finally:
            rdb.execute_command("CLIENT", "UNPAUSE")

        # The record outlived the api; past its deadline the controller settles it, once.
        totals = wait_for(lambda: (lambda t: t if t.get("unconfirmed_executions") == "1" else None)(
            rdb.hgetall(keys.usage_total(workspace))), timeout=30, what="the call settled as unconfirmed",
            state=lambda: (rdb.hgetall(keys.usage_total(workspace)),
                           rdb.zrange(keys.call_deadlines, 0, -1, withscores=True)))
        assert totals["executions"] == "2" and totals["executions:code_execution"] == "2"
        assert rdb.zcard(keys.call_deadlines) == 0 and not rdb.keys(keys.call("*"))
        assert int(rdb.hget(keys.session(session), "inflight")) == 0

        # The session lives on, from the same interpreter, through the api up started again.
        assert _answers_again(client, session, "print(x)")["stdout"] == "42\n"
        wait_for(lambda: rdb.hget(keys.usage_total(workspace), "executions") == "3", timeout=10,
                 what="the next call metered as usual")
        assert rdb.hget(keys.usage_total(workspace), "unconfirmed_executions") == "1"
