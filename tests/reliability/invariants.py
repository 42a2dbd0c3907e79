"""What must hold after a fault: checked from Redis (the usage stream and counters), the disk and HTTP."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
from sp_harness import Stack
from testkit import wait_for
from workload import Record

from sandpool.state import usage
from sandpool.state.keys import Keys


def events(stack: Stack, workspace: str) -> list[dict[str, str]]:
    with stack.rdb() as r:
        entries = r.xrange(Keys(stack.prefix).usage_events, "-", "+")
    return [fields for _, fields in entries if fields.get("workspace") == workspace]


def totals(stack: Stack, workspace: str) -> dict[str, float]:
    with stack.rdb() as r:
        return {k: float(v) for k, v in r.hgetall(Keys(stack.prefix).usage_total(workspace)).items()}


@dataclass
class UsageSnapshot:
    """A workspace's usage events and counters, and its calls still recorded (admitted, their `done` not yet
    run): read in one transaction, so the three agree. A call's `done` meters it (counters and event) and
    removes its record in one step."""

    events: list[dict[str, str]]
    totals: dict[str, float]
    recorded: Counter[str]
    """Calls still recorded, by tool ('' for a file call)."""


def usage_snapshot(stack: Stack, workspace: str) -> UsageSnapshot:
    keys = Keys(stack.prefix)

    def read(pipe: Any) -> None:
        calls = pipe.zrange(keys.call_deadlines, 0, -1)
        pipe.multi()
        pipe.xrange(keys.usage_events, "-", "+")
        pipe.hgetall(keys.usage_total(workspace))
        for call_id in calls:
            pipe.hmget(keys.call(call_id), "workspace", "tool")

    with stack.rdb() as r:  # retried should a call end (or another begin) between its reads
        entries, total, *calls = r.transaction(read, keys.call_deadlines, keys.usage_total(workspace))
    return UsageSnapshot(events=[fields for _, fields in entries if fields.get("workspace") == workspace],
                         totals={k: float(v) for k, v in total.items()},
                         recorded=Counter(tool or "" for owner, tool in calls if owner == workspace))


def assert_never_leased_twice(stack: Stack, workspace: str, record: Record) -> None:
    created = [e for e in events(stack, workspace) if e["type"] == "session_created"]
    sandboxes = Counter(e["sandbox"] for e in created)
    assert [s for s, n in sandboxes.items() if n > 1] == [], "a sandbox was leased twice"
    seen = Counter(record.sandboxes.values())
    assert [s for s, n in seen.items() if n > 1] == [], "two clients were given one sandbox"
    by_session = {e["session"]: e["sandbox"] for e in created}
    for sid, sandbox in record.sandboxes.items():
        assert by_session.get(sid) == sandbox, (sid, sandbox, by_session.get(sid))


def assert_usage_exact(stack: Stack, workspace: str, record: Record, *, unmetered_allowed: int = 0,
                       recorded_allowed: int = 0) -> None:
    """Counters equal the event stream to the unit, and both agree with what the clients saw.

    A call is metered by its `done`, which runs just after its answer is sent: this first waits (bounded)
    until no call of the workspace is left recorded, but for at most `recorded_allowed` whose `done` will
    never come (their api was killed, or Redis failed, before it ran; at most one per client thread per
    fault). The controller settles those once their deadline passes, as unconfirmed executions: until then
    such a call is owed, and counts here with the metered ones.

    `unmetered_allowed`: calls that were already running at the agent when Redis went away
    are answered but not metered (the api will not turn a call that ran into a
    retryable error, and keeps no usage to write later: see docs/reliability.md). At
    most one per client thread per Redis outage.
    """
    seen: list[UsageSnapshot] = []

    def finished() -> bool:
        seen[:] = [usage_snapshot(stack, workspace)]
        return sum(seen[0].recorded.values()) <= recorded_allowed

    wait_for(finished, timeout=30, what=f"at most {recorded_allowed} calls of {workspace} left recorded",
             state=lambda: dict(seen[0].recorded) if seen else None)
    snapshot = seen[0]
    evs, total, owed = snapshot.events, snapshot.totals, snapshot.recorded
    created = [e for e in evs if e["type"] == "session_created"]
    assert total.get(usage.SESSIONS_CREATED, 0) == len(created)
    # Every 201 a client saw is counted once; a create whose answer was lost may be counted (it leased).
    sessions = {e["session"] for e in created}
    assert set(record.created) <= sessions
    assert len(created) - len(record.created) <= record.create_transport_errors, \
        (len(created), len(record.created), record.create_transport_errors)
    released = [e for e in evs if e["type"] == "session_released"]
    assert len({e["session"] for e in released}) == len(released), "a session was released twice"
    seconds = sum(float(e["session_seconds"]) for e in released)
    assert math.isclose(total.get(usage.SESSION_SECONDS, 0.0), seconds, rel_tol=1e-9, abs_tol=1e-6)
    executions = [e for e in evs if e["type"] == "execution"]
    tools = {k.split(":", 1)[1] for k in total if k.startswith(usage.EXECUTIONS + ":")} | set(record.executions)
    for tool in tools:
        counted = sum(int(e[usage.EXECUTIONS]) for e in executions if e["tool"] == tool)
        assert total.get(usage.per_tool(usage.EXECUTIONS, tool), 0) == counted, tool
        # A call can run and be metered even though its answer never reached the client.
        assert counted + owed[tool] >= record.executions[tool] - unmetered_allowed, \
            (tool, counted, owed[tool], record.executions[tool])
    assert total.get(usage.EXECUTIONS, 0) == sum(int(e[usage.EXECUTIONS]) for e in executions)
    owed_executions = sum(n for tool, n in owed.items() if tool)
    assert total.get(usage.EXECUTIONS, 0) + owed_executions >= sum(record.executions.values()) - unmetered_allowed


def assert_sessions_work_or_are_gone(clients: list[httpx.Client], record: Record) -> dict[str, int]:
    """Every session a client was given either still answers or is cleanly gone (404)."""
    outcome: Counter[str] = Counter()
    open_sessions = [s for s in record.created if s not in set(record.destroyed)]
    for sid in open_sessions:
        status = None
        for attempt in range(3):  # a dead sandbox answers 503/502 once, then the session is gone
            client = clients[attempt % len(clients)]
            response = client.get(f"/sessions/{sid}/files/list")
            status = response.status_code
            if status in (200, 404):
                break
            assert status in (502, 503) and response.json().get("reason"), response.text
        assert status in (200, 404), (sid, status)
        if status == 404 and sid in record.destroy_sent:
            outcome["gone after an unanswered destroy"] += 1  # the release ran; its answer was lost
        else:
            outcome["works" if status == 200 else "gone"] += 1
        if status == 200:
            assert client.delete(f"/sessions/{sid}").status_code == 204
    return dict(outcome)


def readyz(service: Any) -> object:
    try:
        return httpx.get(service.url + "/readyz", timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        return repr(exc)


def assert_pool_refilled(stack: Stack, pool_size: int, timeout: float = 90) -> None:
    """After every session is ended (or reaped): the warm target, on disk and in Redis, and no session key.

    Nothing a killed leader was starting may linger either: the next leader drops those records
    once it has led for a leadership term (5 s), long before this gives up.
    """
    keys = Keys(stack.prefix)

    def settled() -> bool:
        with stack.rdb() as r:
            return (r.llen(keys.pool_ready("default")) == pool_size
                    and r.scard(keys.pool_members("default")) == pool_size
                    and r.scard(keys.doomed) == 0 and r.zcard(keys.deadlines) == 0
                    and not list(r.scan_iter(match=keys.session_prefix + "*", count=1000))
                    and len(stack.sandbox_dirs()) == pool_size)

    def state() -> dict[str, Any]:
        with stack.rdb() as r:
            ready, members = r.lrange(keys.pool_ready("default"), 0, -1), r.smembers(keys.pool_members("default"))
            return {"ready": len(ready), "members": len(members),
                    "not ready (state, session, ready_at, owner, created_at)": {
                        sid: r.hmget(keys.sandbox(sid), "state", "session", "ready_at", "owner", "created_at")
                        for sid in members - set(ready)},
                    "doomed": sorted(r.smembers(keys.doomed)), "deadlines": r.zrange(keys.deadlines, 0, -1),
                    "sessions": sorted(r.scan_iter(match=keys.session_prefix + "*", count=1000)),
                    "dirs": sorted(stack.sandbox_dirs()),
                    # Who leads, and whether each live controller still runs its loop (one that
                    # stopped would say "not running").
                    "leader": r.get(keys.controller_leader),
                    "readyz": {s.name: readyz(s) for s in stack.services() if s.running()},
                    # Every controller's: the first may be one a test killed, the leader's says why.
                    "controller logs": [s.log_tail() for s in stack.controllers],
                    "api logs": [s.log_tail() for s in stack.apis]}

    wait_for(settled, timeout=timeout, what=f"the pool refilled to {pool_size} with no session left", state=state)


def leader_id(stack: Stack) -> str:
    with stack.rdb() as r:
        return str(r.get(Keys(stack.prefix).controller_leader) or "")


def leader_service(stack: Stack) -> Any:
    """The controller process that leads (replica ids are host-pid-random)."""
    def live_leader() -> Any:
        leader = leader_id(stack)
        pid = int(leader.rsplit("-", 2)[-2]) if leader else None
        # (a killed leader's key names it until its term runs out)
        return next((s for s in stack.controllers if s.running() and s.pid == pid), None)

    return wait_for(live_leader, timeout=30, what="a live leader")


def leased_sandboxes(stack: Stack) -> list[tuple[str, dict[str, Any]]]:
    keys = Keys(stack.prefix)
    out = []
    with stack.rdb() as r:
        for name in r.scan_iter(match=keys.sandbox_prefix + "*", count=1000):
            fields = r.hgetall(name)
            if fields.get("state") == "leased":
                out.append((name[len(keys.sandbox_prefix):], fields))
    return out
