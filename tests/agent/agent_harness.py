"""Real agent processes (`python -m sandpool agent`) on a Unix socket or loopback TCP, and httpx clients.

The process itself is the kit's `AgentProcess` (tests/testkit.py); this adds the calls the agent
tests make through it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from testkit import AgentProcess

REPO = Path(__file__).resolve().parents[2]
SESSION = "s1"
"""The one session every agent test calls its agent for: an agent serves the first session a call names
and no other (`agent.fence`; tests/agent/test_fence.py)."""
S = f"/sessions/{SESSION}"


class Agent(AgentProcess):
    """An agent with one client that presents its secret, and the tool calls as methods."""

    client: httpx.Client

    def exec(self, tool: str, *, timeout: int | None = None, tool_use_id: str | None = None,
             **fields: Any) -> httpx.Response:
        body: dict[str, Any] = {"tool": tool, "input": fields}
        if timeout is not None:
            body["timeout_seconds"] = timeout
        if tool_use_id is not None:
            body["tool_use_id"] = tool_use_id
        return self.client.post(f"{S}/exec", json=body)

    def py(self, code: str, **kw: Any) -> dict[str, Any]:
        resp = self.exec("code_execution", code=code, **kw)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def sh(self, command: str, **kw: Any) -> dict[str, Any]:
        resp = self.exec("bash_code_execution", command=command, **kw)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def edit(self, command: str, path: str, **kw: Any) -> dict[str, Any]:
        resp = self.exec("text_editor_code_execution", command=command, path=path, **kw)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def stop(self, grace: float = 15.0) -> int:
        self.client.close()
        return super().stop(grace)


def start_agent(tmp: Path, *args: str, uds: bool = True, env: dict[str, str] | None = None,
                secret: str | None = None, wait: bool = True, kind: type[Agent] = Agent,
                pass_fds: tuple[int, ...] = ()) -> Agent:
    agent = kind(tmp / "workspace", tmp / "agent.log", *args, socket_path=tmp / "agent.sock" if uds else None,
                 secret=secret, env=env, cwd=REPO, pass_fds=pass_fds).start()
    agent.client = agent.new_client(agent.secret)
    if wait:
        try:
            agent.wait_healthy(timeout=30)
        except BaseException:
            agent.stop()
            raise
    return agent


def content(result: dict[str, Any]) -> dict[str, Any]:
    return result["result_block"]["content"]
