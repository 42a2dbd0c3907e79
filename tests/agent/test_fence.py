"""The agent's session fence (DESIGN.md, "Redis"; `agent.fence`): an agent serves the first session
id an authenticated call names, and a call for any other session is refused and ends the sandbox, so
that a lease a Redis failover forgot can never give one sandbox's state to a second session."""

from __future__ import annotations

from pathlib import Path

import httpx
from agent_harness import content, start_agent
from testkit import survivors, wait_for

from sandpool.contract.agent_protocol import FENCED_HEADER

FIRST, SECOND = "/sessions/first-session", "/sessions/second-session"
CODE = "code_execution"


def refused(response: httpx.Response) -> bool:
    return (response.status_code == 409 and response.headers.get(FENCED_HEADER) == "true"
            and response.json()["reason"] == "conflict")


def test_a_second_session_is_refused_and_the_sandbox_ends(tmp_path: Path) -> None:
    agent = start_agent(tmp_path)
    try:
        # A caller without the secret claims nothing: the first session is still free to take.
        assert agent.new_client(None).post(f"{SECOND}/exec", json={"tool": CODE, "input": {"code": "1"}}
                                           ).status_code == 401
        first = agent.client.post(f"{FIRST}/exec", json={"tool": CODE, "input": {
            "code": "import os\nx = 42\nopen('kept.txt', 'w').write('the first session')\nprint(os.getpid())"}})
        assert first.status_code == 200, first.text
        interpreter = int(content(first.json())["stdout"])
        assert content(agent.client.post(f"{FIRST}/exec", json={"tool": CODE, "input": {"code": "print(x)"}}
                                         ).json())["stdout"] == "42\n"

        # The second session: refused before anything runs, and nothing of the first is shown.
        second = agent.client.post(f"{SECOND}/exec", json={"tool": CODE, "input": {"code": "print(x)"}})
        assert refused(second), (second.status_code, second.headers, second.text)
        assert "42" not in second.text

        # The sandbox ends: the first session's interpreter is killed at once, every later call
        # (the first session's too, and file reads) gets the same refusal, and the agent exits.
        assert survivors([interpreter], timeout=10) == []
        for method, path, params in (("GET", f"{SECOND}/files", {"path": "kept.txt"}),
                                     ("GET", f"{SECOND}/files/list", {}),
                                     ("GET", f"{FIRST}/files", {"path": "kept.txt"})):
            try:
                later = agent.client.request(method, path, params=params)
            except httpx.TransportError:  # the agent is already gone: nothing answers at all
                break
            assert refused(later), (path, later.status_code, later.text)
            assert "the first session" not in later.text
        wait_for(lambda: agent.proc.poll() is not None, timeout=15, what="the fenced agent to exit")
    finally:
        agent.stop()
    assert "serves another session" in agent.logs()


def test_the_first_session_named_is_served_whatever_the_call(tmp_path: Path) -> None:
    """Any session-scoped call claims the agent (a file call as well as an Execute), and the served
    session keeps being served: the fence refuses only another id."""
    agent = start_agent(tmp_path)
    try:
        put = agent.client.post(f"{FIRST}/files", files={"file": ("a.txt", b"mine")}, data={"path": "a.txt"})
        assert put.status_code == 201, put.text
        for _ in range(3):
            ok = agent.client.post(f"{FIRST}/exec", json={"tool": CODE,
                                                          "input": {"code": "print(open('a.txt').read())"}})
            assert content(ok.json())["stdout"] == "mine\n"
        assert agent.client.get("/healthz").status_code == 200
        assert refused(agent.client.delete(f"{SECOND}/exec"))
    finally:
        agent.stop()
