"""One reconciliation pass at a given pool size, alone: the leader's CPU to read and judge it, and Redis's.

`bench/scale.py` measures a pass in a running installation under load, where every figure moves with
what else runs; this isolates it. It starts its own `redis-server` (the suite's `RedisServer`), writes
`--members` sandbox records straight into it (most leased to a session that names them, one in 50
ready: an installation full of idle sessions), and runs `SandboxStore.survey` and `reconcile.plan`
against a provider that runs all but one in 997 of them (so the plan has work to decide), `--runs` times:

- read CPU: this process's CPU for the survey (the script calls, the replies parsed);
- read + plan CPU: and the plan judged (here in one go, where the controller slices it);
- Redis CPU: `INFO cpu` around the pass, and its commands (`INFO commandstats`).

    python bench/reconcile_pass.py --members 100000 --runs 3

The survey is not paced here (`rest=0`): the controller's pass waits twice as long as each read took
between reads (`ControllerTiming.reconcile_rest`), which moves its wall time, not its CPU.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from scale import command_counts, commands_between, redis_cpu  # bench/ is this script's directory
from testkit import RedisServer

from sandpool.controller import reconcile
from sandpool.controller.provider import SandboxInfo
from sandpool.state.client import close, connect
from sandpool.state.keys import Keys
from sandpool.state.sandboxes import SandboxStore

POOL = "default"


def sandbox_id(n: int) -> str:
    return f"sb-{n:08x}"


def populate(r: redis.Redis, keys: Keys, members: int) -> None:
    """Records as the controller and the lease write them (the fields a survey reads, and a session's
    `sandbox`)."""
    now = f"{time.time():.3f}"
    pipe = r.pipeline(transaction=False)
    for n in range(members):
        sandbox = sandbox_id(n)
        pipe.sadd(keys.pool_members(POOL), sandbox)
        record = {"state": "ready", "pool": POOL, "owner": "bench", "created_at": now}
        if n % 50:
            session = f"s-{n:08x}"
            record.update(state="leased", session=session)
            pipe.hset(keys.session(session), mapping={"sandbox": sandbox, "workspace": f"w{n % 100}",
                                                      "created_at": now})
        pipe.hset(keys.sandbox(sandbox), mapping=record)
        if n % 5000 == 4999:
            pipe.execute()
    pipe.execute()


async def one_pass(url: str, keys: Keys, running: dict[str, SandboxInfo], r: redis.Redis) -> dict[str, Any]:
    client = connect(url, timeout=30)
    store = SandboxStore(client, keys, record_ttl_seconds=600)
    try:
        commands, redis0 = command_counts(r), redis_cpu(r)
        cpu, wall = time.process_time(), time.perf_counter()
        survey = await store.survey([POOL])
        read = time.process_time() - cpu
        situation = reconcile.Situation(now=time.time(), replica_id="bench", start_timeout=60.0, term=5.0,
                                        led_for=100.0)
        settled = getattr(survey, "settled", None)  # None: a build from before settled members were read as ids
        decided = reconcile.plan(survey.records, running, survey.sessions, situation,
                                 *([settled] if settled is not None else []))
        used, took = time.process_time() - cpu, time.perf_counter() - wall
        return {"read_cpu_ms": round(read * 1000, 1), "read_and_plan_cpu_ms": round(used * 1000, 1),
                "wall_ms": round(took * 1000, 1), "redis_cpu_ms": round((redis_cpu(r) - redis0) * 1000, 1),
                "actions": len(decided.actions),
                "redis_commands": commands_between(commands, command_counts(r), count=6)}
    finally:
        await close(client)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=100_000, help="sandboxes the pool owns")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(Path(directory))
        server.start()
        try:
            r = redis.Redis(port=server.port)
            keys = Keys("reconcile-bench")
            populate(r, keys, args.members)
            running = {sandbox_id(n): SandboxInfo(sandbox_id(n), POOL, ready=True)
                       for n in range(args.members) if n % 997}
            for run in range(args.runs):
                result = asyncio.run(one_pass(server.url, keys, running, r))
                print(f"run {run + 1}: {result}")
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
