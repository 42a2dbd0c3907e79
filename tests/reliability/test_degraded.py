"""A slow agent, a full workspace disk and an unreachable Redis are answered with clear errors.

Through the deployed path (api -> sandbox, the controller keeping the pool): each answer is a 5xx
with a `reason` (and `Retry-After` where a retry can help) within the client's
timeout, never a hang; other sessions are unaffected meanwhile; and everything
works again once the fault is gone. Client timeouts of 30 s turn a hang into a
failure; no test asserts a duration.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import httpx
import pytest
from invariants import assert_pool_refilled, events
from sp_harness import Stack, build_stack
from testkit import wait_for

from sandpool.state.keys import Keys

POOL = 3


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    built = build_stack(auth=True, pool_size=POOL, max_sandboxes=POOL + 4,
                        # Idle 10 s: a lease Redis runs after its caller gave up (see the Redis test) is reaped.
                        api_args=["--capacity-wait-seconds", "5", "--exec-grace-seconds", "1",
                                  "--default-idle-timeout-seconds", "10",
                                  "--forward-timeout-seconds", "2", "--redis-timeout-seconds", "1"],
                        controller_args=["--workspace-size-mb", "4", "--redis-timeout-seconds", "1"])
    yield built
    built.close()


def is_ready(url: str) -> bool:
    return httpx.get(url + "/readyz", timeout=5).status_code == 200


def session(stack: Stack, client: httpx.Client) -> str:
    response = client.post("/sessions", json={})
    assert response.status_code == 201, response.text
    return response.json()["session_id"]


def agent_pid(stack: Stack, sid: str) -> int:
    with stack.rdb() as r:
        sandbox = r.hget(Keys(stack.prefix).session(sid), "sandbox")
    return int((stack.root / "sandboxes" / str(sandbox) / "agent.pid").read_text().split()[0])


def exec_py(client: httpx.Client, sid: str, code: str, **extra: Any) -> httpx.Response:
    return client.post(f"/sessions/{sid}/exec", json={"tool": "code_execution", "input": {"code": code}, **extra})


def reasoned_5xx(response: httpx.Response) -> str:
    assert 500 <= response.status_code < 600 and response.status_code != 500, response.text
    body = response.json()
    assert body["detail"] and body["reason"], body
    return str(body["reason"])


def test_a_stalled_agent_is_a_reasoned_error_and_blocks_no_one_else(stack: Stack) -> None:
    with stack.client("slow") as client:
        stalled, healthy, reader = session(stack, client), session(stack, client), session(stack, client)
        pids = [agent_pid(stack, stalled), agent_pid(stack, reader)]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)  # the agent accepts connections (the kernel does) and never answers
        try:
            answers: dict[str, httpx.Response] = {}

            def call(name: str, fn: Any) -> None:
                answers[name] = fn()

            threads = [threading.Thread(target=call, args=("exec", lambda: exec_py(client, stalled, "print(1)",
                                                                                   timeout_seconds=1))),
                       threading.Thread(target=call, args=("get", lambda: client.get(
                           f"/sessions/{reader}/files", params={"path": "x"})))]
            for t in threads:
                t.start()
            # Meanwhile another session of the same workspace is served.
            ok = exec_py(client, healthy, "print(2)")
            assert ok.status_code == 200 and ok.json()["result_block"]["content"]["stdout"] == "2\n"
            for t in threads:
                t.join(60)
                assert not t.is_alive(), "a call to a stalled agent hung"
            assert reasoned_5xx(answers["exec"]) in ("sandbox_failed", "sandbox_unavailable")
            assert reasoned_5xx(answers["get"]) in ("sandbox_failed", "sandbox_unavailable")
            # Those sessions are cleanly gone; their sandboxes are replaced.
            assert client.get(f"/sessions/{stalled}/files/list").status_code == 404
            assert client.get(f"/sessions/{reader}/files/list").status_code == 404
        finally:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        assert client.delete(f"/sessions/{healthy}").status_code == 204
    assert_pool_refilled(stack, POOL)


@pytest.mark.isolation  # the size cap is a tmpfs: root only
def test_a_full_workspace_is_a_clear_error_and_recoverable(stack: Stack) -> None:
    with stack.client("disk") as client:
        sid = session(stack, client)
        fill = client.post(f"/sessions/{sid}/exec", json={"tool": "bash_code_execution", "input": {
            "command": "head -c 64M /dev/zero > fill.bin; echo rc=$?"}})
        assert fill.status_code == 200
        content = fill.json()["result_block"]["content"]
        assert "rc=0" not in content["stdout"] and "No space left" in content["stderr"], content
        put = client.post(f"/sessions/{sid}/files", files={"file": ("more.bin", b"x" * 65536)})
        assert put.status_code == 503 and put.json()["reason"] == "workspace_full", put.text
        edit = client.post(f"/sessions/{sid}/exec", json={"tool": "text_editor_code_execution", "input": {
            "command": "create", "path": "note.txt", "file_text": "x" * 65536}})
        assert edit.status_code == 200, edit.text
        assert edit.json()["result_block"]["content"]["return_code"] == 1
        assert "full" in edit.json()["result_block"]["content"]["stderr"]
        assert exec_py(client, sid, "print(3)").json()["result_block"]["content"]["stdout"] == "3\n"
        listing = client.get(f"/sessions/{sid}/files/list")
        assert listing.status_code == 200 and "more.bin" not in listing.text
        # Freeing space makes the same upload work: nothing was left half-written.
        client.post(f"/sessions/{sid}/exec", json={"tool": "bash_code_execution", "input": {"command": "rm fill.bin"}})
        again = client.post(f"/sessions/{sid}/files", files={"file": ("more.bin", b"x" * 65536)})
        assert again.status_code == 201, again.text
        assert client.delete(f"/sessions/{sid}").status_code == 204
    assert_pool_refilled(stack, POOL)


def test_an_unreachable_redis_is_a_prompt_503_everywhere_and_nothing_breaks(stack: Stack) -> None:
    with stack.client("redisless") as client:
        sid = session(stack, client)
        assert client.post(f"/sessions/{sid}/files", files={"file": ("a.txt", b"kept")}).status_code == 201
        stack.redis.pause()  # SIGSTOP: connections are accepted, nothing is answered
        try:
            answers = {
                "create": client.post("/sessions", json={}),
                "exec": exec_py(client, sid, "print(1)"),
                "get": client.get(f"/sessions/{sid}/files", params={"path": "a.txt"}),
                "list": client.get(f"/sessions/{sid}/files/list"),
                "destroy": client.delete(f"/sessions/{sid}"),
            }
            for name, response in answers.items():
                assert response.status_code == 503, (name, response.text)
                assert reasoned_5xx(response) in ("redis_unavailable", "unavailable"), (name, response.text)
                assert response.headers.get("retry-after"), name
            for service in (stack.api, stack.controllers[0]):
                ready = httpx.get(service.url + "/readyz", timeout=30)
                assert ready.status_code == 503, (service.name, ready.text)
                assert ready.json()["checks"]["redis"] == "unreachable", (service.name, ready.text)
                assert httpx.get(service.url + "/healthz", timeout=30).status_code == 200
        finally:
            stack.redis.resume()
        # Back: the session is intact and usable, and new sessions are leased again.
        for service in (stack.api, stack.controllers[0]):
            wait_for(partial(is_ready, service.url), timeout=30, what=f"the {service.name} ready again")
        assert client.get(f"/sessions/{sid}/files", params={"path": "a.txt"}).content == b"kept"
        assert exec_py(client, sid, "print(4)").json()["result_block"]["content"]["stdout"] == "4\n"
        other = session(stack, client)
        assert client.delete(f"/sessions/{other}").status_code == 204
        assert client.delete(f"/sessions/{sid}").status_code == 204
    # A CreateSession answered 503 while Redis was stopped may still lease when Redis resumes (the
    # script was already sent). The api releases that id once Redis answers again, long
    # before the 10 s idle timeout would have reaped it: the reason says which of the two did it.
    answered = {sid, other}

    def orphans_released() -> bool:
        evs = events(stack, "redisless")
        orphans = {e["session"] for e in evs if e["type"] == "session_created"} - answered
        reasons = {e["session"]: e["reason"] for e in evs if e["type"] == "session_released"}
        assert all(reasons.get(o, "abandoned") == "abandoned" for o in orphans), reasons
        return all(o in reasons for o in orphans)

    wait_for(orphans_released, timeout=30, what="a lease run after its caller gave up released")
    assert_pool_refilled(stack, POOL, timeout=60)
