"""Soak: many sessions through the whole stack, then nothing left over and memory back where it was.

Through `sandpool api` -> real sandboxes kept warm by `sandpool controller`
(pool controller, local provider), client threads cycle sessions: create, every tool
kind, upload, download, list, destroy. Afterwards: exactly the warm target of
sandboxes (in Redis, on disk, as processes), the same Redis key names as after
the warm-up (sandbox ids aside), no extra descriptor in any service, the RSS of
every service within a small margin of its warmed-up figure, and the usage
counters equal to what the clients did, to the unit.

CI runs 1,000 sessions (`SANDPOOL_SOAK_SESSIONS` overrides); `make test-long`
(SANDPOOL_LONG=1) runs 10,000.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from typing import Any

import pytest
from sp_harness import LONG, Stack, build_stack
from testkit import descendants, fd_count, rss_kib, usage_settled, wait_for
from workload import EXECS, Workload

from sandpool.state import usage
from sandpool.state.keys import Keys

SESSIONS = int(os.environ.get("SANDPOOL_SOAK_SESSIONS", "10000" if LONG else "1000"))
WARMUP = 40
POOL = 4
THREADS = 3
RSS_MARGIN_KIB = 24 * 1024     # absolute slack: allocator arenas, caches filled once
RSS_MARGIN_RATIO = 0.15        # and relative slack
FD_MARGIN = 8
FILES_EVERY = 5                # upload + download + list in every 5th session (all the tools in every one)


def services(stack: Stack) -> dict[str, int]:
    """The long-lived processes: api, controller, the controller's zygote(s), Redis."""
    controller = stack.controllers[0].pid
    out = {"api": stack.api.pid, "controller": controller, "redis": stack.redis.proc.pid}  # type: ignore[union-attr]  # the stack's own Redis runs
    for child in sorted(descendants(controller)):
        if _ppid(child) == controller:
            out[f"controller-child-{len(out)}"] = child  # the zygote (its children are the sandboxes)
    return out


def _ppid(pid: int) -> int:
    stat = open(f"/proc/{pid}/stat").read()
    return int(stat[stat.rfind(")") + 2:].split()[1])


def key_shape(stack: Stack) -> Counter[str]:
    """Redis key names with ids made anonymous: what kinds of keys exist, and how many of each."""
    names = stack.keys()
    shape: Counter[str] = Counter()
    windows = re.compile(r":rate:|:(leases|releases):\d+$")  # rate windows and lease/release buckets
    with stack.rdb() as r:
        for name in names:
            if windows.search(name):  # they must expire, and are left out of the shape
                assert r.ttl(name) > 0, name
    for name in names:
        if windows.search(name):
            continue
        name = re.sub(r"sandbox:[^:]+$", "sandbox:<id>", name)
        name = re.sub(r":day:\d{4}-\d{2}-\d{2}$", ":day:<date>", name)
        shape[name] += 1
    return shape


def totals(stack: Stack, workspace: str) -> dict[str, float]:
    with stack.rdb() as r:
        return {k: float(v) for k, v in r.hgetall(Keys(stack.prefix).usage_total(workspace)).items()}


def snapshot(stack: Stack) -> dict[str, Any]:
    procs = services(stack)
    with stack.rdb() as r:
        info = r.info("memory")
        stream = r.memory_usage(Keys(stack.prefix).usage_events) or 0
    return {"rss": {n: rss_kib(p) for n, p in procs.items()}, "fds": {n: fd_count(p) for n, p in procs.items()},
            "procs": len(descendants(stack.controllers[0].pid)), "keys": key_shape(stack),
            "redis_mem": int(info["used_memory"]) - int(stream)}


def settle(stack: Stack) -> None:
    """The pool back at its warm target, no session left, and no call left recorded (a call's `done`, which
    meters it and removes its record, runs just after its answer)."""
    keys = Keys(stack.prefix)
    with stack.rdb() as r:
        wait_for(lambda: r.llen(keys.pool_ready("default")) == POOL and r.scard(keys.pool_members("default")) == POOL
                 and r.scard(keys.doomed) == 0 and r.zcard(keys.deadlines) == 0 and r.zcard(keys.call_deadlines) == 0,
                 timeout=60, what="the pool settled at its warm target with no session or call left")
    wait_for(lambda: len(stack.sandbox_dirs()) == POOL, timeout=30, what="only the warm sandboxes on disk")


def metered(figures: dict[str, float]) -> dict[str, float]:
    """What the workload's calls add to its workspace's usage: executions per tool, bytes moved."""
    fields = [usage.per_tool(usage.EXECUTIONS, body["tool"]) for body in EXECS]
    return {field: figures.get(field, 0) for field in (*fields, usage.BYTES_UPLOADED, usage.BYTES_DOWNLOADED)}


def owed(workload: Workload, base: dict[str, float]) -> dict[str, float]:
    """`metered` figures after `workload`, from `base`: what its clients were answered for, to the unit."""
    record = workload.record
    figures = metered(base)
    for tool, count in record.executions.items():
        figures[usage.per_tool(usage.EXECUTIONS, tool)] += count
    figures[usage.BYTES_UPLOADED] += 1000 * record.statuses["put 201"]
    figures[usage.BYTES_DOWNLOADED] += 3 * record.statuses["get 200"]  # "42\n"
    return figures


def run(stack: Stack, sessions: int) -> Workload:
    workload = Workload([stack.api.url], Keys(stack.prefix), stack.rdb,
                        headers={"Authorization": f"Bearer {stack.token('soak', ttl_seconds=86400)}"},
                        threads=THREADS, sessions=sessions, deadline_s=3600, files_every=FILES_EVERY)
    record = workload.start().join(timeout=3600)
    assert record.bad == [], record.bad[:10]
    assert record.transport_errors == Counter(), record.transport_errors
    assert record.gone == set(), "a session vanished under a soak with no faults"
    assert len(record.created) == sessions == len(record.destroyed), (len(record.created), len(record.destroyed))
    return workload


@pytest.mark.timeout(14400 if LONG else 600)
def test_soak_leaves_nothing_behind_and_memory_returns(stacks: list[Stack]) -> None:
    stack = build_stack(auth=True, pool_size=POOL, max_sandboxes=POOL * 2, api_args=["--capacity-wait-seconds", "5"])
    stacks.append(stack)
    warmup = run(stack, WARMUP)  # fill caches, pools and allocator arenas once
    settle(stack)
    usage_before = usage_settled(lambda: totals(stack, "soak"), metered, owed(warmup, {}))
    before = snapshot(stack)
    started = time.monotonic()
    workload = run(stack, SESSIONS)
    elapsed = time.monotonic() - started
    settle(stack)
    wait_for(lambda: snapshot(stack)["procs"] == before["procs"], timeout=30,
             what=f"the controller's process tree back to {before['procs']}")
    after = snapshot(stack)

    # Nothing left over: sandboxes (Redis, disk, processes), keys, descriptors.
    assert after["keys"] == before["keys"], (after["keys"] - before["keys"], before["keys"] - after["keys"])
    assert after["procs"] == before["procs"]
    for name, fds in after["fds"].items():
        assert fds <= before["fds"][name] + FD_MARGIN, (name, before["fds"][name], fds)
    # Memory back within a small margin of the warmed-up figure, for every service.
    for name, rss in after["rss"].items():
        limit = before["rss"][name] * (1 + RSS_MARGIN_RATIO) + RSS_MARGIN_KIB
        assert rss <= limit, (name, before["rss"][name], rss)
    assert after["redis_mem"] <= before["redis_mem"] * (1 + RSS_MARGIN_RATIO) + RSS_MARGIN_KIB * 1024, \
        (before["redis_mem"], after["redis_mem"])
    # Usage is exact: what the clients did, counted once (every call's `done` ran: `settle`).
    done = usage_settled(lambda: totals(stack, "soak"), metered, owed(workload, usage_before))
    record = workload.record
    assert done[usage.SESSIONS_CREATED] - usage_before.get(usage.SESSIONS_CREATED, 0) == SESSIONS
    for body in EXECS:
        tool = body["tool"]
        field = usage.per_tool(usage.EXECUTIONS, tool)
        assert done[field] - usage_before.get(field, 0) == record.executions[tool]
    downloads = record.statuses["get 200"]  # this run's own record (the warm-up had another)
    assert downloads >= SESSIONS // FILES_EVERY - THREADS
    assert done[usage.BYTES_DOWNLOADED] - usage_before.get(usage.BYTES_DOWNLOADED, 0) == 3 * downloads
    print(f"\nsoak: {SESSIONS} sessions in {elapsed:.1f}s ({SESSIONS / elapsed:.1f}/s); rss KiB before "
          f"{before['rss']} after {after['rss']}; fds before {before['fds']} after {after['fds']}")
