"""End to end through the real multi-tenant api (the edge over the session layer) and real agents.

Tenancy holds on every session operation (whatever `X-Sandpool-*` headers a
client sends), files cross byte for byte, quotas and budgets are exact under
concurrency, and usage read through the admin API matches a scripted workload,
also after the api restarts.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import httpx
from testkit import usage_settled, wait_for

from .stack import PRINT_1, Stack


def upload(client: httpx.Client, session_id: str, path: str, data: bytes) -> tuple[httpx.Response, int]:
    request = client.build_request("POST", f"/sessions/{session_id}/files",
                                   files={"file": (path, data, "application/octet-stream")}, data={"path": path})
    body = request.read()
    return client.send(request), len(body)


def test_another_workspace_cannot_touch_a_session_by_any_operation(stack: Stack) -> None:
    stack.sandboxes.publish_agents(1)
    with stack.client("acme") as acme, stack.client("globex") as globex:
        created = acme.post("/sessions", json={})
        assert created.status_code == 201, created.text
        sid = created.json()["session_id"]
        assert acme.post(f"/sessions/{sid}/exec", json=PRINT_1).json()["result_block"]["content"]["stdout"] == "1\n"
        assert upload(acme, sid, "note.txt", b"mine")[0].status_code == 201
        payload = os.urandom(3 * 1024 * 1024 + 17)  # byte for byte, both ways
        assert upload(acme, sid, "a b.bin", payload)[0].status_code == 201
        assert acme.get(f"/sessions/{sid}/files", params={"path": "a b.bin"}).content == payload

        forged = {"X-Sandpool-Workspace": "acme"}  # ignored: the token decides
        probes = [
            globex.post(f"/sessions/{sid}/exec", json={"tool": "bash_code_execution",
                                                       "input": {"command": "echo pwned > note.txt"}}, headers=forged),
            globex.get(f"/sessions/{sid}/files/list", headers=forged),
            globex.get(f"/sessions/{sid}/files", params={"path": "note.txt"}, headers=forged),
            upload(globex, sid, "note.txt", b"theirs")[0],
        ]
        unknown = globex.get("/sessions/no-such-session/files/list")
        for probe in probes:
            assert probe.status_code == 404, probe.text
            assert probe.json() == unknown.json()  # exactly what an unknown id gets
        assert globex.delete(f"/sessions/{sid}", headers=forged).status_code == 204

        # The session is intact and still acme's.
        assert acme.get(f"/sessions/{sid}/files", params={"path": "note.txt"}).content == b"mine"
        listed = acme.get(f"/sessions/{sid}/files/list").json()["files"]
        assert sorted(f["path"] for f in listed) == ["a b.bin", "note.txt"]
        assert acme.get("/v1/sessions").json()["sessions"][0]["session_id"] == sid
        assert globex.get("/v1/sessions").json()["sessions"] == []
        assert acme.delete(f"/sessions/{sid}").status_code == 204
        assert acme.post(f"/sessions/{sid}/exec", json=PRINT_1).status_code == 404


async def _creates(url: str, token: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as client:
        return await asyncio.gather(*(client.post("/sessions", json={}) for _ in range(count)))


def test_concurrent_session_quota_is_exact_under_20_concurrent_creates(stack: Stack) -> None:
    for _ in range(12):
        stack.sandboxes.publish()
    with stack.client("ops", admin=True) as admin:
        assert admin.put("/v1/workspaces/acme/policy", json={"max_concurrent_sessions": 5}).status_code == 200
    responses = asyncio.run(_creates(stack.api.url, stack.keys.token("acme"), 20))
    created = [r for r in responses if r.status_code == 201]
    refused = [r for r in responses if r.status_code == 429]
    assert len(created) == 5 and len(refused) == 15, [r.status_code for r in responses]
    for response in refused:
        assert response.json()["limit"] == "max_concurrent_sessions" and "retry-after" in response.headers
    assert stack.ready() == 7  # nothing leased beyond the quota
    with stack.client("acme") as acme:
        assert len(acme.get("/v1/sessions").json()["sessions"]) == 5
        usage = acme.get("/v1/usage").json()["total"]
        assert usage["sessions_created"] == 5 and usage["quota_refusals"] == 15
        # Releasing one frees exactly one slot.
        assert acme.delete(f"/sessions/{created[0].json()['session_id']}").status_code == 204
        assert acme.post("/sessions", json={}).status_code == 201
        assert acme.post("/sessions", json={}).status_code == 429


def test_daily_budget_exhaustion_is_a_429_until_midnight(stack: Stack) -> None:
    for _ in range(3):
        stack.sandboxes.publish()
    with stack.client("ops", admin=True) as admin:
        assert admin.put("/v1/workspaces/acme/policy",
                         json={"daily_session_seconds_budget": 1}).status_code == 200
    with stack.client("acme") as acme:
        first = acme.post("/sessions", json={})
        assert first.status_code == 201
        started = time.time()
        wait_for(lambda: time.time() - started > 1.1, timeout=5, what="one session-second")
        assert acme.delete(f"/sessions/{first.json()['session_id']}").status_code == 204
        refused = acme.post("/sessions", json={})
        assert refused.status_code == 429, refused.text
        assert refused.json()["limit"] == "daily_session_seconds_budget"
        assert 1 <= int(refused.headers["retry-after"]) <= 86400
        total = acme.get("/v1/usage").json()["total"]
        assert total["session_seconds"] >= 1 and total["quota_refusals"] == 1
    with stack.client("globex") as globex:  # another workspace is not charged
        assert globex.post("/sessions", json={}).status_code == 201
    assert stack.ready() == 1


def _workload(stack: Stack) -> dict[str, Any]:
    """Two sessions: four executions, one upload, one download; both destroyed. Returns the bytes moved."""
    moved = {"up": 0, "down": 0}
    with stack.client("acme") as acme:
        first = acme.post("/sessions", json={}).json()["session_id"]
        second = acme.post("/sessions", json={}).json()["session_id"]
        for _ in range(2):
            assert acme.post(f"/sessions/{first}/exec", json=PRINT_1).status_code == 200
        assert acme.post(f"/sessions/{first}/exec", json={"tool": "bash_code_execution",
                                                         "input": {"command": "echo hi"}}).status_code == 200
        assert acme.post(f"/sessions/{second}/exec", json=PRINT_1).status_code == 200
        response, sent = upload(acme, first, "data.bin", b"x" * 1000)
        assert response.status_code == 201 and sent > 1000  # the multipart framing is not the file
        moved["up"] += 1000
        download = acme.get(f"/sessions/{first}/files", params={"path": "data.bin"})
        assert download.content == b"x" * 1000
        moved["down"] += len(download.content)
        for sid in (first, second):
            assert acme.delete(f"/sessions/{sid}").status_code == 204
    return moved


def calls_of(total: dict[str, Any]) -> tuple[int, int, int]:
    """What a workspace's calls added to its usage: executions, bytes uploaded, bytes downloaded."""
    return total["executions"], total["bytes_uploaded"], total["bytes_downloaded"]


def test_usage_is_exact_after_a_workload_and_across_a_restart(stack_factory: Callable[[], Stack]) -> None:
    stack = stack_factory()
    stack.sandboxes.publish_agents(4)
    moved = _workload(stack)
    with stack.client("acme") as acme:
        # The last calls are metered just after their answers: wait for the workload's exact figures.
        before = usage_settled(
            lambda: acme.get("/v1/usage", params={"from": time.strftime("%Y-%m-%d", time.gmtime())}).json(),
            lambda u: calls_of(u["total"]), (4, moved["up"], moved["down"]))
    total = before["total"]
    # Counts exactly; times exactly as the session layer's clock metered them (the event stream).
    events = [e for _, e in stack.rdb.xrange(stack.rkeys.usage_events) if e.get("workspace") == "acme"]
    executions = [e for e in events if e["type"] == "execution"]
    seconds_of = {tool: round(sum(float(e["execution_seconds"]) for e in executions if e["tool"] == tool), 3)
                  for tool in ("code_execution", "bash_code_execution")}
    session_seconds = round(sum(float(e["session_seconds"]) for e in events if e["type"] == "session_released"), 3)
    # Every other counter is there and 0 (the usage shape is fixed, docs/api.md).
    assert {k: v for k, v in total.items() if v and k not in ("by_tool", "execution_seconds", "session_seconds")} == {
        "sessions_created": 2, "executions": 4, "bytes_uploaded": moved["up"], "bytes_downloaded": moved["down"]}
    assert moved == {"up": 1000, "down": 1000}  # file bytes only
    assert {tool: figures["executions"] for tool, figures in total["by_tool"].items()} == {
        "code_execution": 3, "bash_code_execution": 1, "text_editor_code_execution": 0}
    assert {tool: round(figures["execution_seconds"], 3) for tool, figures in total["by_tool"].items()} == {
        **seconds_of, "text_editor_code_execution": 0}
    assert round(total["execution_seconds"], 3) == round(sum(seconds_of.values()), 3) > 0
    assert round(total["session_seconds"], 3) == session_seconds > 0
    assert before["days"][0]["counters"] == total  # everything happened today (UTC)
    assert sum(1 for e in events if e["type"] == "session_created") == 2

    restarted = stack_factory()  # a new api on the same Redis
    with restarted.client("acme") as acme:
        assert acme.get("/v1/usage", params={"from": before["days"][0]["day"]}).json() == before
    moved_again = _workload(restarted)
    with restarted.client("acme") as acme:
        after = usage_settled(lambda: acme.get("/v1/usage").json()["total"], calls_of,
                              (8, moved["up"] + moved_again["up"], moved["down"] + moved_again["down"]))
    assert after["sessions_created"] == 4 and after["executions"] == 8
    assert after["by_tool"]["code_execution"]["executions"] == 6
    assert after["by_tool"]["bash_code_execution"]["executions"] == 2
    assert after["bytes_uploaded"] == moved["up"] + moved_again["up"]
    assert after["bytes_downloaded"] == moved["down"] + moved_again["down"]
    with restarted.client("globex") as globex:
        untouched = globex.get("/v1/usage").json()["total"]
    assert not any(v for k, v in untouched.items() if k != "by_tool")
    assert all(figures == {"executions": 0, "execution_seconds": 0} for figures in untouched["by_tool"].values())
