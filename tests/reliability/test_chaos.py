"""Chaos under load: kill -9 of an agent, of the leading controller (two running), of the api, and
Redis restarted gracefully or crashed, each while client threads are working.

After each: every session a client was given either still works or is cleanly
gone (404); no sandbox was ever leased twice (usage stream and clients agree);
usage counters equal the event stream to the unit; the pool refills to its warm
target with nothing left over. CI runs a short form of each; SANDPOOL_LONG=1
adds longer runs with more faults (`slow`).
"""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from invariants import (
    assert_never_leased_twice,
    assert_pool_refilled,
    assert_sessions_work_or_are_gone,
    assert_usage_exact,
    leader_service,
    leased_sandboxes,
)
from sp_harness import Stack, build_stack
from testkit import wait_for
from workload import Workload

from sandpool.state.keys import Keys

POOL = 3
# Sessions nobody can destroy (their create's answer was lost with a killed process) are reaped quickly:
# the api gives them a short idle timeout, the controller's session reaper runs often.
CHAOS_API_ARGS = ["--capacity-wait-seconds", "5", "--exec-grace-seconds", "3", "--default-idle-timeout-seconds", "4",
                  "--forward-connect-timeout-seconds", "1"]
CHAOS_CONTROLLER_ARGS = ["--reap-interval-seconds", "0.2"]
SHORT, LONG_RUN = (45, 1), (400, 4)  # (sessions, faults)
# Under a fault a create may also end its capacity wait with `start_timeout` (the leader died
# with its sandboxes and the next one is still taking over): a correct answer, retried, never a
# lost or doubled session. The soak, which injects no fault, does not allow it.
CHAOS_5XX = ("at_capacity", "start_timeout", "redis_unavailable", "sandbox_unavailable", "sandbox_failed",
             "unavailable")
RUNS = [pytest.param(SHORT, id="short", marks=pytest.mark.timeout(300)),
        pytest.param(LONG_RUN, id="long", marks=[pytest.mark.slow, pytest.mark.timeout(3600)])]


def standalone_workload(stack: Stack, sessions: int, urls: list[str] | None = None, *,
                        allowed_5xx: tuple[str, ...] = CHAOS_5XX, **kw: object) -> Workload:
    return Workload(urls or [s.url for s in stack.apis], Keys(stack.prefix), stack.rdb,
                    threads=3, sessions=sessions, calls_per_session=2, allowed_5xx=allowed_5xx, **kw)  # type: ignore[arg-type]  # kw: more of Workload's own arguments


def wait_progress(workload: Workload, done: int) -> None:
    wait_for(lambda: workload.done_sessions() >= done or not any(w.is_alive() for w in workload._workers),
             timeout=120, what=f"{done} sessions done")


def settle_and_check(stack: Stack, workspace: str, workload: Workload, clients: list[httpx.Client], *,
                     recorded_allowed: int = 0) -> dict[str, int]:
    record = workload.join()
    assert record.bad == [], record.bad[:10]
    assert_never_leased_twice(stack, workspace, record)
    outcome = assert_sessions_work_or_are_gone(clients, record)
    assert_pool_refilled(stack, POOL)
    assert_usage_exact(stack, workspace, record, recorded_allowed=recorded_allowed)
    return outcome


@pytest.mark.parametrize("run", RUNS)
def test_kill_9_of_agents_under_load(stacks: list[Stack], run: tuple[int, int]) -> None:
    sessions, faults = run
    stack = build_stack(pool_size=POOL, max_sandboxes=POOL * 3, api_args=CHAOS_API_ARGS,
                        controller_args=CHAOS_CONTROLLER_ARGS)
    stacks.append(stack)
    # A call to the killed agent's session ends in whichever reaches the api first: the broken connection
    # (sandbox_failed, sandbox_unavailable) or the session's release for its lost sandbox (session_ended).
    workload = standalone_workload(stack, sessions, allowed_5xx=(*CHAOS_5XX, "session_ended")).start()
    killed = []
    for fault in range(faults):
        wait_progress(workload, (fault + 1) * sessions // (faults + 2))
        leased = wait_for(lambda: leased_sandboxes(stack), timeout=30, what="a leased sandbox")
        sandbox_id, _ = leased[0]
        pid = int((stack.root / "sandboxes" / sandbox_id / "agent.pid").read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        killed.append(sandbox_id)
    with stack.client() as client:
        outcome = settle_and_check(stack, "_standalone", workload, [client])
    assert set(killed).isdisjoint(stack.sandbox_dirs())  # killed sandboxes were replaced, not reused
    assert workload.record.created, outcome


@pytest.mark.parametrize("run", RUNS)
def test_kill_9_of_the_leading_controller_with_two_running(stacks: list[Stack], run: tuple[int, int]) -> None:
    """The leading controller dies with (local provider) every sandbox it made; the standby takes over,
    the two apis (clients round-robin over them) carry on."""
    sessions, faults = run
    stack = build_stack(pool_size=POOL, max_sandboxes=POOL * 3, replicas=2, apis=2, api_args=CHAOS_API_ARGS,
                        controller_args=CHAOS_CONTROLLER_ARGS)
    stacks.append(stack)
    workload = standalone_workload(stack, sessions).start()
    for fault in range(faults):
        wait_progress(workload, (fault + 1) * sessions // (faults + 2))
        victim = leader_service(stack)
        victim.kill9()
        if fault + 1 < faults:  # a replacement replica on the dead one's port, for the next fault
            stack.replace(victim)
    clients = [httpx.Client(base_url=s.url, timeout=30) for s in stack.apis]
    try:
        record = workload.join()
        assert record.bad == [], record.bad[:10]
        assert_never_leased_twice(stack, "_standalone", record)
        assert_sessions_work_or_are_gone(clients, record)
        # Nothing the dead leader was starting lingers: the new leader drops it after a leadership term.
        assert_pool_refilled(stack, POOL, timeout=150)
        assert_usage_exact(stack, "_standalone", record)
    finally:
        for client in clients:
            client.close()


@pytest.mark.parametrize("run", RUNS)
def test_kill_9_of_the_api_loses_no_session(stacks: list[Stack], run: tuple[int, int]) -> None:
    """Multi-tenant: the api holds no session (they live in Redis and the sandboxes, which the
    controller keeps): kill -9 of it mid-call loses none, and one started again carries on."""
    sessions, faults = run
    stack = build_stack(auth=True, pool_size=POOL, max_sandboxes=POOL * 3, api_args=CHAOS_API_ARGS,
                        controller_args=CHAOS_CONTROLLER_ARGS)
    stacks.append(stack)
    token = stack.token("chaos", ttl_seconds=3600)
    workload = Workload([stack.api.url], Keys(stack.prefix), stack.rdb,
                        headers={"Authorization": f"Bearer {token}"}, threads=3, sessions=sessions,
                        calls_per_session=2, allowed_5xx=CHAOS_5XX).start()
    for fault in range(faults):
        wait_progress(workload, (fault + 1) * sessions // (faults + 2))
        stack.api.kill9()
        stack.replace(stack.api)  # same port, same key: it keeps nothing, so it carries on
    with httpx.Client(base_url=stack.api.url, headers={"Authorization": f"Bearer {token}"},
                      timeout=30) as client:
        # A call the killed api had admitted (at most one per client thread) stays recorded: its `done`, which
        # runs just after its answer, never came; the controller settles it after its deadline, minutes away.
        outcome = settle_and_check(stack, "chaos", workload, [client], recorded_allowed=workload.threads * faults)
    # The api holds nothing: no session died with it.
    assert outcome.get("gone", 0) == 0 and not workload.record.gone, outcome


@pytest.mark.parametrize("run", RUNS)
def test_redis_restarted_gracefully_then_crashed_under_load(stacks: list[Stack], run: tuple[int, int]) -> None:
    """As `sandpool up` runs it (AOF, fsync every second): a graceful restart loses nothing. Then,
    switched to `appendfsync always`, a kill -9 loses no write a client was answered for."""
    sessions, faults = run
    stack = build_stack(pool_size=POOL, max_sandboxes=POOL * 3, appendonly=True, appendfsync="everysec",
                        api_args=[*CHAOS_API_ARGS, "--redis-timeout-seconds", "2"],
                        controller_args=[*CHAOS_CONTROLLER_ARGS, "--redis-timeout-seconds", "2"])
    stacks.append(stack)
    with stack.client() as client:
        keeper = client.post("/sessions", json={"idle_timeout_seconds": 600}).json()["session_id"]  # lives on
        assert client.post(f"/sessions/{keeper}/files", files={"file": ("k.txt", b"kept")}).status_code == 201
    workload = standalone_workload(stack, sessions)
    workload.record.created.append(keeper)  # so the usage check counts it
    workload.start()
    # 1. Graceful restarts (SIGTERM: redis-server fsyncs its AOF before it exits; same port, same data).
    for fault in range(faults):
        wait_progress(workload, (fault + 1) * sessions // (2 * faults + 2))
        stack.redis.stop()
        stack.redis.start()
    with stack.client() as client:
        kept = client.get(f"/sessions/{keeper}/files", params={"path": "k.txt"})
        assert kept.content == b"kept", (kept.status_code, kept.text, stack.api.log_tail())
    assert workload.record.gone == set(), "a graceful restart lost a session"
    # 2. Crashes with every write fsynced: what a client was answered for survives.
    with stack.rdb() as r:
        r.config_set("appendfsync", "always")
    for fault in range(faults):
        wait_progress(workload, sessions // 2 + (fault + 1) * sessions // (2 * faults + 2))
        with workload.record.lock:
            acknowledged = [s for s in workload.record.created if s not in set(workload.record.destroyed)]
        stack.redis.kill9()
        stack.redis.start()
        with stack.rdb() as r:
            r.config_set("appendfsync", "always")  # (the command-line setting is everysec)
            lost = [sid for sid in acknowledged if not r.exists(Keys(stack.prefix).session(sid))
                    and sid not in workload.record.destroy_sent and sid not in workload.record.gone]
        assert lost == [], f"acknowledged sessions lost by a crash with appendfsync always: {lost}"
    record = workload.join()
    assert record.bad == [], record.bad[:10]
    with stack.client() as client:
        assert client.get(f"/sessions/{keeper}/files", params={"path": "k.txt"}).content == b"kept"
        assert_never_leased_twice(stack, "_standalone", record)
        outcome = assert_sessions_work_or_are_gone([client], record)
        assert outcome.get("gone", 0) == 0, outcome
    # A doomed sandbox the controller popped as Redis went down is put back once Redis answers.
    assert_pool_refilled(stack, POOL, timeout=120)
    # A call whose `done` failed with Redis away stays recorded (if its record outlived a crash) until the
    # controller settles it after its deadline.
    assert_usage_exact(stack, "_standalone", record, unmetered_allowed=workload.threads * 2 * faults,
                       recorded_allowed=workload.threads * 2 * faults)
