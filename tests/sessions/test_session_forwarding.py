"""Execute and the file operations through the api to real `sandpool agent` processes:
the full contract, clamping, byte-for-byte forwarding, tenancy probes, dead agents, usage."""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sessions_harness import publish
from test_lease_repeats import stores
from testkit import usage_settled, wait_for

from sandpool.contract import tenancy
from sandpool.contract.models import ExecResponse, FileList, FileUploadResult, SessionHandle


def code(source: str, **extra: object) -> dict[str, object]:
    return {"tool": "code_execution", "input": {"code": source}, **extra}


@pytest.fixture
def stack(api, agents, r, keys):
    """A standalone api with `count` real agents published as ready sandboxes."""

    def make(count: int = 1, **settings: object):
        app = api(**settings)
        for agent in agents.start(count):
            publish(r, keys, address=agent.address, secret=agent.secret)
        return app

    return make


def test_the_full_contract_through_the_api(stack, r, keys) -> None:
    app = stack(1)
    with httpx.Client(base_url=app.url, timeout=30) as c:
        created = c.post("/sessions", json={})
        assert created.status_code == 201
        sid = SessionHandle.model_validate(created.json()).session_id
        base = f"/sessions/{sid}"

        first = c.post(base + "/exec", json=code("x = 41\nprint('hi')"), headers={"X-Request-Id": "req-1"})
        assert first.status_code == 200, first.text
        assert first.headers["x-request-id"] == "req-1"
        assert "x-sandpool-outcome" not in first.headers  # consumed by the api
        result = ExecResponse.model_validate(first.json())
        assert result.result_block.content.stdout == "hi\n"
        assert result.result_block.type == "code_execution_tool_result"
        assert first.json()["timeout_seconds"] == 60  # the default in force, filled in by the api

        second = c.post(base + "/exec", json=code("print(x + 1)", tool_use_id="t-2"))
        assert second.json()["result_block"]["content"]["stdout"] == "42\n"  # state persists
        assert second.json()["tool_use_id"] == "t-2"

        failed = c.post(base + "/exec", json=code("raise SystemExit(3)"))
        assert failed.status_code == 200 and failed.json()["result_block"]["content"]["return_code"] != 0

        bash = c.post(base + "/exec", json={"tool": "bash_code_execution", "input": {"command": "echo $((6*7))"}})
        assert bash.status_code == 200 and bash.json()["result_block"]["content"]["stdout"] == "42\n"

        edit = c.post(base + "/exec", json={"tool": "text_editor_code_execution",
                                            "input": {"command": "create", "path": "notes.txt", "file_text": "a\n"}})
        assert edit.status_code == 200
        assert edit.json()["result_block"]["type"] == "text_editor_code_execution_tool_result"

        payload = os.urandom(50_000) + b"\x00\xff"
        put = c.post(base + "/files", files={"file": ("blob.bin", payload)}, data={"path": "in/blob.bin"})
        assert put.status_code == 201, put.text
        assert FileUploadResult.model_validate(put.json()).size_bytes == len(payload)

        listed = c.get(base + "/files/list", params={"path": "in"})
        assert listed.status_code == 200
        assert [f.path for f in FileList.model_validate(listed.json()).files] == ["in/blob.bin"]

        got = c.get(base + "/files", params={"path": "in/blob.bin"})
        assert got.status_code == 200 and got.content == payload  # byte for byte

        assert c.get(base + "/files", params={"path": "missing.txt"}).status_code == 404
        assert c.get(base + "/files", params={"path": "../etc/passwd"}).status_code == 403
        assert c.get(base + "/files", params={"path": "in"}).status_code == 400

        assert c.delete(base).status_code == 204
        gone = c.post(base + "/exec", json=code("print(1)"))
        assert gone.status_code == 404 and gone.json() == {"detail": "session not found", "reason": "not_found"}
        assert c.delete(base).status_code == 204
    # The last calls are metered just after their answers: wait for the exact figures.
    used = usage_settled(lambda: r.hgetall(keys.usage_total(tenancy.STANDALONE_WORKSPACE)),
                         lambda u: (u.get("executions"), u.get("bytes_uploaded"), u.get("bytes_downloaded")),
                         ("5", str(len(payload)), str(len(payload))))
    assert used["executions:code_execution"] == "3" and used["executions:bash_code_execution"] == "1"
    assert used["executions:text_editor_code_execution"] == "1"


MALFORMED_EXEC = [
    (b"{", 422, "invalid_request"), (b"[1]", 422, "invalid_request"), (b"", 422, "invalid_request"),
    (b'{"tool": "fortran", "input": {}}', 400, "unknown_tool_kind"),
    (b'{"tool": "code_execution", "input": {}}', 422, "invalid_request"),
    (b'{"tool": "code_execution", "input": {"code": "print(1)"}, "timeout_seconds": 0}', 422, "invalid_request"),
    (b'{"tool": "text_editor_code_execution", "input": {"command": "create", "path": "a"}}', 422, "invalid_request"),
]


def test_malformed_exec_is_refused_and_the_session_still_works(stack, r, keys) -> None:
    app = stack(1)
    sid = httpx.post(app.url + "/sessions").json()["session_id"]
    for body, status, reason in MALFORMED_EXEC:
        resp = httpx.post(f"{app.url}/sessions/{sid}/exec", content=body,
                          headers={"content-type": "application/json"})
        assert (resp.status_code, resp.json()["reason"]) == (status, reason), body
        assert "print(1)" not in resp.text  # the offending input is never echoed
    # Nothing was metered, nothing is left in flight, and the session still works.
    assert r.hget(keys.session(sid), "inflight") == "0"
    assert set(r.hgetall(keys.usage_total(tenancy.STANDALONE_WORKSPACE))) == {"sessions_created"}
    ok = httpx.post(f"{app.url}/sessions/{sid}/exec", json=code("print(2)"), timeout=30)
    assert ok.status_code == 200 and ok.json()["result_block"]["content"]["stdout"] == "2\n"
    usage_settled(lambda: r.hget(keys.usage_total(tenancy.STANDALONE_WORKSPACE), "executions:code_execution"),
                  lambda executions: executions, "1")  # metered just after its answer


def test_bodies_over_the_cap_are_413_and_change_nothing(stack, r, keys) -> None:
    app = stack(1, max_body_bytes=4096)
    sid = httpx.post(app.url + "/sessions").json()["session_id"]
    big = code("x = '" + "a" * 10_000 + "'")
    assert httpx.post(f"{app.url}/sessions/{sid}/exec", json=big).status_code == 413
    up = httpx.post(f"{app.url}/sessions/{sid}/files", files={"file": ("f.bin", b"z" * 10_000)})
    assert up.status_code == 413 and up.json()["reason"] == "payload_too_large"

    # A chunked upload (no Content-Length) is cut off at the cap too.
    def chunks():
        for _ in range(10):
            yield b"y" * 1000

    streamed = httpx.post(f"{app.url}/sessions/{sid}/files?path=s.bin", content=chunks(),
                          headers={"content-type": "multipart/form-data; boundary=xyz"})
    assert streamed.status_code == 413
    listed = httpx.get(f"{app.url}/sessions/{sid}/files/list").json()
    assert listed["files"] == []
    # The list call ends (its `done`) just after its answer: then no call of the session is in flight,
    # and none of the refused uploads was metered.
    wait_for(lambda: r.hget(keys.session(sid), "inflight") == "0", timeout=10, what="no call in flight")
    assert "bytes_uploaded" not in r.hgetall(keys.usage_total(tenancy.STANDALONE_WORKSPACE))


def test_exec_timeout_is_clamped_to_the_ceiling(stack) -> None:
    app = stack(1, max_exec_timeout_seconds=1)
    sid = httpx.post(app.url + "/sessions").json()["session_id"]
    assert httpx.post(app.url + "/sessions").status_code == 503  # the one sandbox is leased
    resp = httpx.post(f"{app.url}/sessions/{sid}/exec", json=code("import time; time.sleep(30)", timeout_seconds=100),
                      timeout=30)
    assert resp.status_code == 200
    assert resp.json()["timeout_seconds"] == 1  # clamped, not refused
    metrics = httpx.get(app.url + "/metrics").text
    assert 'sandpool_executions_total{outcome="timeout",tool="code_execution"} 1.0' in metrics


def test_cross_workspace_probes_get_exactly_the_unknown_id_answer(tenant_api, agents, r, keys) -> None:
    app = tenant_api()
    (agent,) = agents.start(1)
    publish(r, keys, address=agent.address, secret=agent.secret)
    owner = app.headers("owner")
    sid = httpx.post(app.url + "/sessions", headers=owner).json()["session_id"]
    ok = httpx.post(f"{app.url}/sessions/{sid}/exec", headers=owner, json=code("secret = 7"), timeout=30)
    assert ok.status_code == 200
    # The call is metered (and its session marked active) just after its answer: the state before the
    # probes is the state once that happened.
    usage_settled(lambda: r.hgetall(keys.usage_total("owner")), lambda u: u.get("executions"), "1")
    before = r.hgetall(keys.session(sid))
    deadline = r.zscore(keys.deadlines, sid)
    events = r.xlen(keys.usage_events)

    intruder = app.headers("intruder")
    probes = [
        ("POST", "/exec", {"json": code("print(secret)")}),
        ("GET", "/files/list", {}),
        ("GET", "/files", {"params": {"path": "x"}}),
        ("POST", "/files", {"files": {"file": ("x", b"x")}}),
        ("DELETE", "", {}),
    ]
    for method, suffix, kwargs in probes:
        theirs = httpx.request(method, f"{app.url}/sessions/{sid}{suffix}", headers=intruder, **kwargs)
        unknown = httpx.request(method, f"{app.url}/sessions/no-such-session{suffix}", headers=intruder, **kwargs)
        assert (theirs.status_code, theirs.content) == (unknown.status_code, unknown.content), suffix
        assert theirs.status_code == (204 if method == "DELETE" else 404)
    assert r.hgetall(keys.session(sid)) == before  # untouched: not even last activity
    assert r.zscore(keys.deadlines, sid) == deadline
    assert r.xlen(keys.usage_events) == events
    assert not r.exists(keys.usage_total("intruder"))
    still = httpx.post(f"{app.url}/sessions/{sid}/exec", headers=owner, json=code("print(secret)"), timeout=30)
    assert still.json()["result_block"]["content"]["stdout"] == "7\n"


def test_the_callers_credential_never_reaches_the_agent(tenant_api, agents, r, keys) -> None:
    app = tenant_api()
    (agent,) = agents.start(1)
    publish(r, keys, address=agent.address, secret=agent.secret)
    token = app.token("acme")
    headers = {"Authorization": f"Bearer {token}", "Cookie": "c=1", "X-Sandpool-Extra": "1"}
    sid = httpx.post(app.url + "/sessions", headers=headers).json()["session_id"]
    # The agent's view of its own request, from inside the sandbox: no variable carries it,
    # and the agent accepted the call, so it saw its own secret and not the caller's token.
    resp = httpx.post(f"{app.url}/sessions/{sid}/exec", headers=headers, timeout=30,
                      json={"tool": "bash_code_execution", "input": {"command": "env"}})
    assert resp.status_code == 200
    assert token not in resp.text and token.split(".")[2] not in resp.text


def test_a_killed_agent_gives_503_then_404_and_its_sandbox_is_doomed(stack, agents, r, keys) -> None:
    app = stack(1)
    (agent,) = agents.started
    sid = httpx.post(app.url + "/sessions").json()["session_id"]
    sandbox = r.hget(keys.session(sid), "sandbox")
    agent.kill()
    dead = httpx.post(f"{app.url}/sessions/{sid}/exec", json=code("print(1)"), timeout=30)
    assert dead.status_code in (502, 503), dead.text
    assert dead.json()["reason"] in ("sandbox_unavailable", "sandbox_failed")
    assert httpx.post(f"{app.url}/sessions/{sid}/exec", json=code("print(1)")).status_code == 404
    assert r.hget(keys.sandbox(sandbox), "state") == "doomed" and r.sismember(keys.doomed, sandbox)
    released = [e[1] for e in r.xrange(keys.usage_events) if e[1]["type"] == "session_released"]
    assert [e["reason"] for e in released] == ["dead"]
    assert 'sandpool_sessions_reaped_total{reason="dead"} 1.0' in httpx.get(app.url + "/metrics").text


def test_an_agent_dying_mid_call_gives_502_then_404(stack, agents, r, keys) -> None:
    app = stack(1)
    (agent,) = agents.started
    sid = httpx.post(app.url + "/sessions").json()["session_id"]
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(httpx.post, f"{app.url}/sessions/{sid}/exec",
                           json=code("import time; time.sleep(20)"), timeout=30)
        wait_for(lambda: r.hget(keys.session(sid), "inflight") == "1", timeout=10, what="call in flight")
        time.sleep(0.2)  # let the agent start running the code (the kill may land either way)
        agent.kill()
        resp = call.result()
    assert resp.status_code in (502, 503)
    assert httpx.get(f"{app.url}/sessions/{sid}/files/list").status_code == 404


def test_one_reaper_call_ends_the_calls_in_flight_of_every_session_it_releases(stack, r, keys, redis_url,
                                                                              redis_prefix) -> None:
    """The reaper names every session one call released in one message on the released channel: the api
    ends each of their calls in flight at once (502, the session gone), not at its exec timeout."""
    app = stack(2)
    sids = [httpx.post(app.url + "/sessions").json()["session_id"] for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(httpx.post, f"{app.url}/sessions/{sid}/exec",
                             json=code("import time; time.sleep(60)"), timeout=30) for sid in sids]
        wait_for(lambda: all(r.hget(keys.session(sid), "inflight") == "1" for sid in sids), timeout=10,
                 what="both calls in flight")

        async def reap() -> list[str]:
            async with stores(redis_url, redis_prefix) as (_, _, sessions, _):
                _, reaped = await sessions.reap(now=time.time() + 10**6, limit=256)  # past every lifetime
                return sorted(result.session_id for result in reaped)

        assert asyncio.run(reap()) == sorted(sids)
        # Within the client's 30 s, well before the code's 60 s sleep or the 60 s exec timeout.
        answers = [call.result() for call in calls]
    for answer in answers:
        assert answer.status_code == 502, answer.text
        assert "released while the call ran" in answer.text
    for sid in sids:
        assert httpx.get(f"{app.url}/sessions/{sid}/files/list").status_code == 404


def test_usage_is_exact_after_a_scripted_workload(stack, r, keys) -> None:
    app = stack(2)
    ws = tenancy.STANDALONE_WORKSPACE
    with httpx.Client(base_url=app.url, timeout=30) as c:
        sids = [c.post("/sessions").json()["session_id"] for _ in range(2)]
        spans = []
        for sid in sids:
            c.post(f"/sessions/{sid}/exec", json=code("print(1)"))
            c.post(f"/sessions/{sid}/exec", json={"tool": "bash_code_execution", "input": {"command": "true"}})
        c.post(f"/sessions/{sids[0]}/exec", json=code("print(2)"))
        upload = c.build_request("POST", f"/sessions/{sids[0]}/files", files={"file": ("a.txt", b"hello" * 100)},
                                 data={"path": "a.txt"})
        assert len(upload.read()) > 500  # the multipart framing, which is not metered
        assert c.send(upload).status_code == 201
        assert c.get(f"/sessions/{sids[0]}/files", params={"path": "a.txt"}).content == b"hello" * 100
        assert c.get(f"/sessions/{sids[0]}/files", params={"path": "missing"}).status_code == 404  # not metered
        for sid in sids:
            created = float(r.hget(keys.session(sid), "created_at"))
            c.delete(f"/sessions/{sid}")
            spans.append(time.time() - created)
    # The last calls are metered just after their answers (even after their sessions ended): wait for them.
    total = usage_settled(lambda: r.hgetall(keys.usage_total(ws)),
                          lambda u: (u.get("executions"), u.get("bytes_uploaded"), u.get("bytes_downloaded")),
                          ("5", "500", "500"))
    assert total["sessions_created"] == "2"
    assert total["executions"] == "5"
    assert total["executions:code_execution"] == "3" and total["executions:bash_code_execution"] == "2"
    assert total["bytes_uploaded"] == "500" and total["bytes_downloaded"] == "500"  # file bytes only
    assert float(total["execution_seconds"]) == pytest.approx(
        float(total["execution_seconds:code_execution"]) + float(total["execution_seconds:bash_code_execution"]),
        abs=0.002)
    assert 0 < float(total["execution_seconds:code_execution"]) < sum(spans)
    assert 0 < float(total["session_seconds"]) <= sum(spans) + 0.01
    assert r.sismember(keys.usage_workspaces, ws)
    kinds = [e[1]["type"] for e in r.xrange(keys.usage_events)]
    assert kinds.count("session_created") == 2 and kinds.count("execution") == 5
    assert kinds.count("upload") == 1 and kinds.count("download") == 1 and kinds.count("session_released") == 2
    # The stream carries the same figures as the counters (a billing consumer can rebuild them).
    streamed = sum(float(e[1]["session_seconds"]) for e in r.xrange(keys.usage_events)
                   if e[1]["type"] == "session_released")
    assert streamed == pytest.approx(float(total["session_seconds"]), abs=0.002)
