"""The pool controller against a real Redis, the real local provider and real agents."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from testkit import eventually

from sandpool.controller.controller import PoolController
from sandpool.controller.provider import PoolSpec
from sandpool.providers.local import procs
from sandpool.state.keys import Keys
from sandpool.state.sessions import Leased, Refused, SessionLimits, SessionStore, Waiting

HERE = Path(__file__).resolve().parent
LIMITS = SessionLimits(idle_timeout_seconds=300, max_lifetime_seconds=3600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)


def pool(warm: int = 2, ceiling: int = 4, name: str = "default") -> PoolSpec:
    return PoolSpec(name=name, image="python", warm=warm, ceiling=ceiling)


def controller(redis, keys, provider, pools, replica="r1", **timing) -> PoolController:
    """With the production safety-net wake: what these tests see happen, events and deadlines made happen."""
    timing.setdefault("leadership_ms", 2000)
    return PoolController(redis, keys, provider, pools, replica_id=replica, **timing)


async def more_passes(c: PoolController, n: int, *, after_each: Any = None) -> None:
    """`n` more passes of the leader's loop, each woken by a nudge (an idle leader sleeps until one)."""
    for _ in range(n):
        before = c.ticks
        c.nudge()

        async def passed(before: int = before) -> bool:
            return c.ticks > before

        await eventually(passed, what="a pass of the leader loop")
        if after_each is not None:
            await after_each()


def start(tasks: list, c: PoolController) -> asyncio.Task:
    task = asyncio.create_task(c.run())
    tasks.append(task)
    return task


async def lease(store: SessionStore, session_id: str, **options: Any) -> Leased | Waiting | Refused:
    """A session of workspace "ws" from the default pool, with the suite's limits."""
    return await store.lease(session_id=session_id, workspace="ws", pool="default", image="python",
                             now=time.time(), limits=LIMITS, workspace_limits={}, **options)


async def ready_ids(redis, keys: Keys, name: str = "default") -> list[str]:
    return await redis.lrange(keys.pool_ready(name), 0, -1)


async def test_fills_the_pool_to_its_warm_target_with_healthy_published_sandboxes(redis, keys, provider, tasks):
    c = controller(redis, keys, provider, [pool(warm=2, ceiling=4)])
    start(tasks, c)
    seen: list[int] = []

    async def two_ready() -> bool:
        seen.append(await redis.scard(keys.pool_members("default")))
        return len(await ready_ids(redis, keys)) == 2

    await eventually(two_ready, what="two ready sandboxes")

    async def members() -> None:
        seen.append(await redis.scard(keys.pool_members("default")))

    await more_passes(c, 5, after_each=members)
    assert max(seen) <= 2  # the warm target, not the ceiling: no create beyond what is missing
    assert c.running and c.is_leader
    assert await redis.get(keys.controller_leader) == "r1"
    ids = await ready_ids(redis, keys)
    assert sorted(await redis.smembers(keys.pool_members("default"))) == sorted(ids)
    running = {s.sandbox_id: s for s in await provider.list()}
    for sandbox_id in ids:
        record = await redis.hgetall(keys.sandbox(sandbox_id))
        assert record["state"] == "ready" and record["pool"] == "default" and record["owner"] == "r1"
        assert record["address"] == running[sandbox_id].address and record["secret"] == running[sandbox_id].secret
        assert float(record["ready_at"]) >= float(record["created_at"])
        assert await redis.pttl(keys.sandbox(sandbox_id)) > 0  # the safety-net expiry is set
    assert set(running) == set(ids)
    assert c.metrics.sandbox_start.labels(pool="default")._sum.get() > 0


async def test_never_exceeds_the_ceiling(redis, keys, provider, tasks):
    c = controller(redis, keys, provider, [pool(warm=3, ceiling=2)])
    start(tasks, c)
    seen: list[int] = []

    async def settled() -> bool:
        seen.append(await redis.scard(keys.pool_members("default")))
        return len(await ready_ids(redis, keys)) == 2

    await eventually(settled, what="the ceiling's worth of ready sandboxes")

    async def members() -> None:
        seen.append(await redis.scard(keys.pool_members("default")))

    await more_passes(c, 5, after_each=members)
    assert max(seen) <= 2
    assert len(await provider.list()) == 2


async def test_a_lease_nudge_settles_but_a_queued_caller_and_a_release_are_served_at_once(
        redis, keys, provider, tasks):
    """The refill a lease sets off waits `nudge_settle_seconds` (the new session's first call goes
    first); a caller queued for a sandbox and a release wake the controller at once. Settle and
    safety-net wake are both longer than the test: only those two nudges can make the controller act here."""
    c = controller(redis, keys, provider, [pool(warm=1, ceiling=3)], safety_wake_seconds=600,
                   nudge_settle_seconds=600)
    start(tasks, c)

    async def one_ready() -> bool:
        return len(await ready_ids(redis, keys)) == 1

    await eventually(one_ready, what="the warm sandbox ready")
    store = SessionStore(redis, keys)
    leased = await lease(store, "sess-1", ceiling=3)
    assert isinstance(leased, Leased)
    await asyncio.sleep(1.0)  # an unsettled nudge would have registered the refill by now (~ms)
    assert await redis.smembers(keys.pool_members("default")) == {leased.sandbox}

    queued = await lease(store, "sess-2", ceiling=3, wait_seconds=30)
    assert isinstance(queued, Waiting)

    async def promised() -> bool:
        return await redis.hget(keys.waiter("sess-2"), "state") == "promised"

    await eventually(promised, timeout=20, what="a sandbox started for the queued caller and promised to it")

    assert await store.release(session_id="sess-1", workspace="ws", now=time.time(), mode="destroy") is not None

    async def destroyed() -> bool:
        return not await redis.sismember(keys.pool_members("default"), leased.sandbox)

    await eventually(destroyed, timeout=20, what="the released sandbox destroyed on the release's nudge")


async def test_replaces_released_sandboxes_promptly_on_the_nudge(redis, keys, provider, tasks):
    # A long safety net: only the PUBLISHes of the lease and the release can wake the controller in time.
    c = controller(redis, keys, provider, [pool(warm=2, ceiling=4)], safety_wake_seconds=120)
    start(tasks, c)

    async def two_ready() -> bool:
        return len(await ready_ids(redis, keys)) == 2

    await eventually(two_ready, what="two ready sandboxes")
    store = SessionStore(redis, keys)
    leased = await lease(store, "sess-1")
    assert isinstance(leased, Leased)
    handle = procs.ProcessHandle.from_line(
        (provider.root / leased.sandbox / "agent.pid").read_text())

    assert leased.sandbox not in await ready_ids(redis, keys)
    assert (await redis.hgetall(keys.sandbox(leased.sandbox)))["state"] == "leased"
    # The lease PUBLISHes the sandbox on the nudge channel too: the controller replaces it at once.
    await eventually(two_ready, what="the leased sandbox replaced on the lease's nudge")

    released = await store.release(session_id="sess-1", workspace="ws", now=time.time(), mode="destroy")
    assert released is not None and released.sandbox == leased.sandbox

    async def destroyed() -> bool:
        return (not (provider.root / leased.sandbox).exists()
                and not await redis.exists(keys.sandbox(leased.sandbox))
                and not await redis.sismember(keys.pool_members("default"), leased.sandbox)
                and not await redis.sismember(keys.doomed, leased.sandbox))

    await eventually(destroyed, timeout=20, what="the released sandbox destroyed and forgotten")
    assert not procs.is_alive(handle)
    await eventually(two_ready, what="the pool refilled")
    assert len(await provider.list()) == 2


async def test_reconciles_orphans_stale_records_and_stuck_starts_after_a_restart(redis, keys, provider, tasks):
    first = controller(redis, keys, provider, [pool(warm=2, ceiling=8)], replica="old")
    first_task = start(tasks, first)

    async def two_ready() -> bool:
        return len(await ready_ids(redis, keys)) == 2

    await eventually(two_ready, what="two ready sandboxes")
    kept = sorted(await ready_ids(redis, keys))
    first_task.cancel()
    await asyncio.gather(first_task, return_exceptions=True)
    assert not first.running

    # What a crash can leave behind:
    spec = pool()
    orphan = await provider.create(spec, "sb-orphan")  # runs, unknown to Redis
    orphan_handle = procs.ProcessHandle.from_line((provider.root / "sb-orphan" / "agent.pid").read_text())
    await provider.create(spec, "sb-stuck")  # runs, record stuck in `starting`
    old = f"{time.time() - 3600:.3f}"
    for sandbox_id, state in (("sb-stuck", "starting"), ("sb-ghost", "starting"), ("sb-stale", "ready"),
                              ("sb-lost", "ready")):
        await redis.hset(keys.sandbox(sandbox_id), mapping={"state": state, "pool": "default", "image": "python",
                                                            "created_at": old, "owner": "old",
                                                            "address": "unix:///nowhere", "secret": "x"})
        await redis.sadd(keys.pool_members("default"), sandbox_id)
    await redis.rpush(keys.pool_ready("default"), "sb-stale")
    await redis.lpush(keys.pool_ready("default"), "sb-lost")
    store = SessionStore(redis, keys)
    leased = await lease(store, "sess-lost")
    assert isinstance(leased, Leased) and leased.sandbox == "sb-lost"
    assert orphan.ready

    second = controller(redis, keys, provider, [pool(warm=2, ceiling=8)], replica="new")
    start(tasks, second)

    async def repaired() -> bool:
        members = sorted(await redis.smembers(keys.pool_members("default")))
        listed = sorted(s.sandbox_id for s in await provider.list())
        return members == kept and listed == kept and sorted(await ready_ids(redis, keys)) == kept

    await eventually(repaired, what="Redis and the provider agreeing on the two kept sandboxes")
    for gone in ("sb-orphan", "sb-stuck", "sb-ghost", "sb-stale", "sb-lost"):
        assert not await redis.exists(keys.sandbox(gone)), gone
        assert not (provider.root / gone).exists(), gone
    assert not procs.is_alive(orphan_handle)
    # The session on the vanished sandbox was released like a dead agent's, metered once.
    assert not await redis.exists(keys.session("sess-lost"))
    assert await redis.zscore(keys.deadlines, "sess-lost") is None
    assert await redis.smembers(keys.workspace_sessions("ws")) == set()
    events = [fields for _, fields in await redis.xrange(keys.usage_events)]
    released = [e for e in events if e.get("type") == "session_released" and e.get("session") == "sess-lost"]
    assert len(released) == 1 and released[0]["reason"] == "dead"
    reconciled = second.metrics.reconciled
    assert reconciled.labels(kind="orphan_sandbox")._value.get() == 1
    assert reconciled.labels(kind="stuck_starting")._value.get() == 2
    assert reconciled.labels(kind="stale_record")._value.get() == 2


async def test_a_dead_agent_under_a_session_is_released_and_replaced(redis, keys, provider, tasks):
    c = controller(redis, keys, provider, [pool(warm=1, ceiling=4)], reconcile_seconds=0.5)
    start(tasks, c)

    async def one_ready() -> bool:
        return len(await ready_ids(redis, keys)) == 1

    await eventually(one_ready, what="a ready sandbox")
    store = SessionStore(redis, keys)
    leased = await lease(store, "sess-d")
    assert isinstance(leased, Leased)
    handle = procs.ProcessHandle.from_line((provider.root / leased.sandbox / "agent.pid").read_text())
    os.killpg(handle.pgid, signal.SIGKILL)

    async def cleaned() -> bool:
        return (not await redis.exists(keys.session("sess-d"))
                and not await redis.exists(keys.sandbox(leased.sandbox))
                and not (provider.root / leased.sandbox).exists())

    await eventually(cleaned, what="the dead sandbox's session released and the sandbox removed")
    await eventually(one_ready, what="the pool warm again")


async def test_exactly_one_leader_and_a_graceful_handover(redis, keys, provider, tasks):
    a = controller(redis, keys, provider, [pool(warm=1, ceiling=2)], replica="a", leadership_ms=1000)
    b = controller(redis, keys, provider, [pool(warm=1, ceiling=2)], replica="b", leadership_ms=1000)
    task_a = start(tasks, a)
    start(tasks, b)
    both: list[bool] = []

    async def one_leads_a_while() -> bool:
        both.append(a.is_leader and b.is_leader)
        a.nudge()  # an idle leader's loop passes only when woken
        b.nudge()
        return (a.is_leader or b.is_leader) and max(a.ticks, b.ticks) >= 10

    await eventually(one_leads_a_while, what="a leader running ten passes")
    assert not any(both)
    assert a.running and b.running
    leader, follower = (a, b) if a.is_leader else (b, a)
    if leader is a:
        task_a.cancel()
    else:
        tasks[1].cancel()

    async def follower_leads() -> bool:
        return follower.is_leader

    await eventually(follower_leads, timeout=15, what="the follower taking over")
    assert await redis.get(keys.controller_leader) == follower.replica_id


async def test_a_killed_leader_is_replaced_within_seconds(redis_url, redis, keys, data_dir, make_provider, tasks):
    proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once; the controller runs in a process of its own
        [sys.executable, str(HERE / "controller_process.py"), redis_url, keys.prefix, str(data_dir), "crashy", "1500",
         "2", "4"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        async def crashy_filled() -> bool:
            return (await redis.get(keys.controller_leader) == "crashy"
                    and len(await ready_ids(redis, keys)) == 2)

        await eventually(crashy_filled, what="the subprocess controller leading a warm pool")
        provider = await make_provider()
        standby = controller(redis, keys, provider, [pool(warm=2, ceiling=4)], replica="standby", leadership_ms=1500)
        start(tasks, standby)

        async def standby_waiting() -> bool:
            return standby.running

        await eventually(standby_waiting, what="the standby running")
        assert not standby.is_leader
        proc.send_signal(signal.SIGKILL)  # no release of leadership, no cleanup: a crash
        proc.wait(10)

        async def took_over() -> bool:
            return standby.is_leader

        await eventually(took_over, timeout=15, what="the standby taking over")
        assert await redis.get(keys.controller_leader) == "standby"

        # Whatever the crash did to the old leader's sandboxes (the subprocess launcher leaves them
        # running and they are adopted; the zygote's die with it and are released and replaced),
        # the new leader ends with a warm pool and Redis agreeing with the provider.
        async def consistent() -> bool:
            standby.nudge()  # its passes counted below come on events, not on a tick
            ready = sorted(await ready_ids(redis, keys))
            members = sorted(await redis.smembers(keys.pool_members("default")))
            listed = sorted(s.sandbox_id for s in await provider.list() if s.ready)
            return len(ready) == 2 and ready == members == listed and standby.ticks >= 3

        async def described() -> str:
            return (f"ready {sorted(await ready_ids(redis, keys))}, members "
                    f"{sorted(await redis.smembers(keys.pool_members('default')))}, provider "
                    f"{[(s.sandbox_id, s.ready) for s in await provider.list()]}, ticks {standby.ticks}")

        await eventually(consistent, what="a warm pool that Redis and the provider agree on", state=described)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_provider_errors_back_off_leave_nothing_behind_and_recover(redis, keys, data_dir, make_provider,
                                                                         tasks):
    provider = await make_provider(launcher="subprocess", agent_python="/nonexistent/python")
    c = controller(redis, keys, provider, [pool(warm=2, ceiling=4)], retry_base_seconds=0.05,
                   retry_max_seconds=0.3, max_concurrent_starts=2)
    start(tasks, c)
    errors = c.metrics.provider_errors.labels(provider="local", operation="create")

    async def failing() -> bool:
        return errors._value.get() >= 6

    await eventually(failing, what="several failed creates")
    assert c._create_failures["default"] >= 3  # consecutive failures drive the backoff
    assert await redis.scard(keys.pool_members("default")) <= 2  # never more than the bounded in-flight
    assert len(list((data_dir / "sandboxes").iterdir())) <= 2

    provider.launcher.python = sys.executable  # the provider heals

    async def warm() -> bool:
        return len(await ready_ids(redis, keys)) == 2

    await eventually(warm, what="the pool filled once the provider works")
    assert "default" not in c._create_failures
    assert sorted(await redis.smembers(keys.pool_members("default"))) == sorted(await ready_ids(redis, keys))
    assert sorted(p.name for p in (data_dir / "sandboxes").iterdir()) == sorted(await ready_ids(redis, keys))


async def test_a_pool_with_a_zero_warm_target_creates_nothing(redis, keys, provider, tasks):
    c = controller(redis, keys, provider, [pool(warm=0, ceiling=4)])
    start(tasks, c)

    await more_passes(c, 5)
    assert await redis.scard(keys.pool_members("default")) == 0
    assert await provider.list() == []


async def test_cancelling_mid_start_stops_promptly_and_leaves_no_half_made_sandbox(redis, provider):
    for delay in (0.0, 0.03, 0.15):
        keys = Keys(prefix=f"cancel{int(delay * 1000)}{os.getpid()}{time.monotonic_ns() % 100000}")
        c = controller(redis, keys, provider, [pool(warm=6, ceiling=6)])
        task = asyncio.create_task(c.run())

        async def starting(c: PoolController = c) -> bool:
            return bool(c._starting)

        await eventually(starting, what="creates in flight")
        await asyncio.sleep(delay)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=20)
        assert done, f"the controller ignored its cancellation (delay {delay})"
        assert not c.running and not c.is_leader
        assert await redis.get(keys.controller_leader) is None  # released, not left to expire
        members = sorted(await redis.smembers(keys.pool_members("default")))
        states = {m: (await redis.hgetall(keys.sandbox(m))).get("state") for m in members}
        assert set(states.values()) <= {"ready"}, states  # nothing left `starting`
        listed = {s.sandbox_id for s in await provider.list()}
        assert set(members) <= listed
        for sandbox_id in listed - set(members):
            raise AssertionError(f"half-made sandbox {sandbox_id} left behind (delay {delay})")
        for sandbox_id in members:  # clean up for the next round
            await provider.destroy(sandbox_id)


async def test_a_lowered_warm_target_retires_the_surplus_and_destroys_it(redis, keys, provider, tasks):
    """Restarted with a lower warm target (or after two leaders' starts overlapped), the pool shrinks
    to the target: the surplus is doomed atomically (never a sandbox a lease took) and destroyed."""
    first = controller(redis, keys, provider, [pool(warm=3, ceiling=4)])
    task = start(tasks, first)

    async def three_ready() -> bool:
        return len(await ready_ids(redis, keys)) == 3

    await eventually(three_ready, what="three ready sandboxes")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    store = SessionStore(redis, keys)
    leased = await store.lease(session_id="kept", workspace="_standalone", pool="default", image="python",
                               now=time.time(), limits=LIMITS, workspace_limits={})
    assert isinstance(leased, Leased)
    second = controller(redis, keys, provider, [pool(warm=1, ceiling=4)])
    start(tasks, second)

    async def shrunk() -> bool:
        return (len(await ready_ids(redis, keys)) == 1 and await redis.scard(keys.pool_members("default")) == 2
                and len(await provider.list()) == 2)

    await eventually(shrunk, what="the pool down to one warm sandbox and the leased one")
    assert (await redis.hgetall(keys.sandbox(leased.sandbox)))["state"] == "leased"
    assert {s.sandbox_id for s in await provider.list()} == {leased.sandbox, *await ready_ids(redis, keys)}
    assert second.metrics.reconciled.labels(kind="surplus_ready")._value.get() == 1


async def test_a_former_leaders_starts_are_forgotten_after_one_term_not_the_start_timeout(redis, keys, provider,
                                                                                          tasks):
    """A leader killed mid-create leaves `starting` records nobody will publish. Once the new leader
    has led for a leadership term (the old one has stopped its creates by then), they are dropped;
    waiting for the 60 s start timeout would hold pool slots that long. A record of its own that is
    not among its starts in flight (its publish failed on a Redis outage, say) is dropped at once; one
    of no known owner keeps the start timeout."""
    now = f"{time.time():.3f}"
    for sandbox_id, owner in (("sb-of-the-dead", "dead-replica"), ("sb-of-mine", "r1"), ("sb-of-nobody", "")):
        await redis.hset(keys.sandbox(sandbox_id), mapping={"state": "starting", "pool": "default",
                                                            "image": "python", "created_at": now, "owner": owner})
        await redis.sadd(keys.pool_members("default"), sandbox_id)
    c = controller(redis, keys, provider, [pool(warm=1, ceiling=4)], leadership_ms=1000)
    assert c.replica_id == "r1"
    start(tasks, c)

    async def dead_ones_gone() -> bool:
        return not await redis.sismember(keys.pool_members("default"), "sb-of-the-dead")

    await eventually(dead_ones_gone, timeout=15, what="the former leader's start forgotten")
    assert not await redis.exists(keys.sandbox("sb-of-the-dead"))
    assert not await redis.exists(keys.sandbox("sb-of-mine"))
    assert (await redis.hgetall(keys.sandbox("sb-of-nobody")))["state"] == "starting"
    assert c.metrics.reconciled.labels(kind="stuck_starting")._value.get() == 2


async def test_a_stray_cancellation_in_the_leader_loop_does_not_end_the_controller(redis, keys, provider, tasks):
    """A step ended by a CancelledError nobody asked for (the recheck reconciliation here) must not end
    `run()`: it would release leadership with no replica left to take it, and a former leader's
    `starting` records (and pool slots, and directories) would stay for good."""
    now = f"{time.time():.3f}"
    await redis.hset(keys.sandbox("sb-of-the-dead"), mapping={"state": "starting", "pool": "default",
                                                               "image": "python", "created_at": now,
                                                               "owner": "dead-replica"})
    await redis.sadd(keys.pool_members("default"), "sb-of-the-dead")
    c = controller(redis, keys, provider, [pool(warm=1, ceiling=4)], leadership_ms=1000)
    real_list, calls = provider.list, []

    async def list_once_cancelled() -> list:
        calls.append(1)
        if len(calls) == 2:  # the reconciliation booked for the former leader's start
            raise asyncio.CancelledError
        return await real_list()

    provider.list = list_once_cancelled
    task = start(tasks, c)

    async def dead_ones_gone() -> bool:
        return not await redis.sismember(keys.pool_members("default"), "sb-of-the-dead")

    await eventually(dead_ones_gone, timeout=15, what="the former leader's start forgotten")
    assert not task.done() and c.running


async def test_a_sandbox_leased_to_a_session_that_is_gone_is_destroyed_and_replaced(redis, keys, provider, tasks):
    """Nothing releases a lease whose session key is gone (no deadline, no session to destroy): left
    alone it would hold a slot of its pool for good. A live lease next to it is kept."""
    c = controller(redis, keys, provider, [pool(warm=2, ceiling=4)])
    start(tasks, c)

    async def two_ready() -> bool:
        return len(await ready_ids(redis, keys)) == 2

    await eventually(two_ready, what="two ready sandboxes")
    store = SessionStore(redis, keys)
    lost, kept = await lease(store, "sess-lost"), await lease(store, "sess-kept")
    assert isinstance(lost, Leased) and isinstance(kept, Leased)
    await redis.delete(keys.session("sess-lost"))
    await c.reconcile()

    async def destroyed() -> bool:
        return (not (provider.root / lost.sandbox).exists()
                and not await redis.exists(keys.sandbox(lost.sandbox))
                and not await redis.sismember(keys.pool_members("default"), lost.sandbox))

    await eventually(destroyed, timeout=20, what="the sessionless sandbox destroyed and forgotten")
    assert c.metrics.reconciled.labels(kind="sessionless_lease")._value.get() == 1
    assert (await redis.hgetall(keys.sandbox(kept.sandbox)))["state"] == "leased"
    assert (provider.root / kept.sandbox).exists()
    await eventually(two_ready, what="the pool refilled")


async def test_a_long_reconciliation_pass_does_not_stop_refills_nor_judge_what_started_meanwhile(
        redis, keys, provider, tasks):
    """At 100,000 sandboxes a pass reads for seconds (docs/capacity.md): the loop goes on topping pools
    up beside it, and a sandbox started while the pass ran is not in the pass's provider list but is
    never taken for a stale record (it would be forgotten, then destroyed as an orphan)."""
    c = controller(redis, keys, provider, [pool(warm=2, ceiling=6)], reconcile_seconds=0.5)
    start(tasks, c)

    async def two_ready() -> bool:
        return len(await ready_ids(redis, keys)) == 2

    await eventually(two_ready, what="two ready sandboxes")
    real_list, held, release = provider.list, asyncio.Event(), asyncio.Event()

    async def held_list() -> list:
        listed = await real_list()  # taken now: what starts from here on is not in it
        held.set()
        await release.wait()
        return listed

    provider.list = held_list
    await asyncio.wait_for(held.wait(), 10)  # a periodic pass is in, and stays in, its provider list
    store = SessionStore(redis, keys)
    leased = [await lease(store, f"sess-{i}") for i in range(2)]
    assert all(isinstance(x, Leased) for x in leased)
    await eventually(two_ready, what="the pool refilled while the pass is held")
    started_meanwhile = set(await ready_ids(redis, keys))
    release.set()
    provider.list = real_list
    await more_passes(c, 3)
    await asyncio.sleep(1.0)  # the released pass, and at least one more, have decided and acted
    assert set(await ready_ids(redis, keys)) == started_meanwhile
    assert all((provider.root / sid).exists() for sid in started_meanwhile)
    assert [await redis.exists(keys.session(f"sess-{i}")) for i in range(2)] == [1, 1]
