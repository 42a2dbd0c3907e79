"""A tool kind added from this file alone reaches a real agent; unregistered, it is unknown again.

`echo` (stdout: its input's `text`) is declared here as the contract's request model plus the
agent's tool, the two things a new kind needs besides its docs (docs/agent.md, "Adding a tool
kind"). The agent under test is a real `sandpool agent` process started by running this file as a
script: it registers the kind, then runs the agent's command line, as `python -m sandpool` would.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from agent_harness import REPO, Agent, S, start_agent

from sandpool import cli
from sandpool.agent import tools
from sandpool.agent.execution import ExecOutcome, OutputListener
from sandpool.agent.runtime import Runtime
from sandpool.agent.tools import Tool
from sandpool.contract.models import (
    TOOL_KINDS,
    ExecRequest,
    ToolInput,
    UnknownTool,
    parse_exec_request,
    register_tool_kind,
    unregister_tool_kind,
)
from sandpool.core.errors import UnknownToolKind

FORGET = "TOOL_REGISTRY_TEST_FORGET"
"""Set to 1 in the agent's environment: the script registers echo and unregisters it before serving."""


# --- the new tool kind: all of it --------------------------------------------------------------

class EchoInput(ToolInput):
    text: str


class EchoRequest(ExecRequest):
    tool: Literal["echo"]
    input: EchoInput


async def run_echo(runtime: Runtime, call: EchoInput, timeout: float, on_output: OutputListener | None) -> ExecOutcome:
    if on_output is not None:
        on_output("stdout", call.text.encode())
    return ExecOutcome(stdout=call.text, stderr="", return_code=0)


ECHO = Tool[EchoInput](kind="echo", run=run_echo, snapshots_files=False, timed=False)


def register_echo() -> None:
    register_tool_kind(EchoRequest)
    tools.register(ECHO)


def unregister_echo() -> None:
    tools.unregister("echo")
    unregister_tool_kind("echo")


# --- the agents --------------------------------------------------------------------------------

class EchoAgent(Agent):
    launcher = (str(Path(__file__).resolve()),)


def start_echo_agent(tmp: Path, *, forget: bool = False) -> Agent:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO / "tests" / "agent")])}
    if forget:
        env[FORGET] = "1"
    return start_agent(tmp, env=env, kind=EchoAgent)


@pytest.fixture(scope="module")
def echo_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    agent = start_echo_agent(tmp_path_factory.mktemp("echo-agent"))
    yield agent
    agent.stop()


def forget_echo_here() -> None:
    """Leave this (the test) process without echo, whatever a test did."""
    if tools.get("echo") is not None:
        tools.unregister("echo")
    if "echo" in TOOL_KINDS:
        unregister_tool_kind("echo")


def json_bytes(value: object) -> bytes:
    """How the agent renders a JSON body (compact, UTF-8)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


# --- the tests ---------------------------------------------------------------------------------

def test_the_new_kind_answers_its_result_block(echo_agent: Agent) -> None:
    resp = echo_agent.client.post(f"{S}/exec", json={"tool": "echo", "input": {"text": "héllo\n"},
                                                             "tool_use_id": "toolu_echo"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-sandpool-outcome"] == "ok"
    elapsed = resp.json()["execution_time_ms"]
    assert resp.content == json_bytes({
        "tool_use_id": "toolu_echo", "execution_time_ms": elapsed,
        "result_block": {"type": "echo_tool_result", "tool_use_id": "toolu_echo",
                         "content": {"type": "code_execution_result", "stdout": "héllo\n", "stderr": "",
                                     "return_code": 0, "content": []}}})
    # the built-in kinds are served alongside it
    assert echo_agent.py("print(6 * 7)")["result_block"]["content"]["stdout"] == "42\n"


def test_the_new_kind_streams_because_its_tool_says_so(echo_agent: Agent) -> None:
    with echo_agent.client.stream("POST", f"{S}/exec", json={"tool": "echo", "input": {"text": "streamed"}},
                                  headers={"Accept": "text/event-stream"}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines()]
    assert "event: stdout" in lines and 'data: {"text":"streamed"}' in lines
    assert ": outcome ok" in lines
    result = lines[lines.index("event: result") + 1].removeprefix("data: ")
    answer = json.loads(result)
    assert answer["result_block"]["type"] == "echo_tool_result"
    assert answer["result_block"]["content"]["stdout"] == "streamed"
    assert result.encode() == json_bytes(answer)  # the non-streaming body's rendering


def test_the_new_kind_is_validated_by_its_own_model(echo_agent: Agent) -> None:
    resp = echo_agent.client.post(f"{S}/exec", json={"tool": "echo", "input": {"txt": "typo"}})
    assert resp.status_code == 422
    assert resp.json()["detail"] == [{"loc": ["echo", "input", "text"], "msg": "Field required", "type": "missing"}]


def test_an_unregistered_kind_is_unknown_again(tmp_path: Path) -> None:
    agent = start_echo_agent(tmp_path, forget=True)
    try:
        resp = agent.client.post(f"{S}/exec", json={"tool": "echo", "input": {"text": "x"}})
        assert resp.status_code == 400, resp.text
        assert resp.json()["reason"] == UnknownToolKind.reason
        assert "'echo'" in resp.json()["detail"] and "code_execution" in resp.json()["detail"]
        assert agent.py("print(1)")["result_block"]["content"]["stdout"] == "1\n"
    finally:
        agent.stop()


def test_registering_and_unregistering_in_one_process() -> None:
    code = {"tool": "code_execution", "input": {"code": "1"}}
    echo = {"tool": "echo", "input": {"text": "x"}}
    parse_exec_request(code)  # the parser is built before echo exists: registering must rebuild it
    register_echo()
    try:
        parsed = parse_exec_request(echo)
        assert isinstance(parsed, EchoRequest) and parsed.input.text == "x"
        assert tools.get("echo") is ECHO and "echo" in TOOL_KINDS
        unregister_echo()
        assert tools.get("echo") is None and "echo" not in TOOL_KINDS
        with pytest.raises(UnknownTool):
            parse_exec_request(echo)
        assert parse_exec_request(code).tool == "code_execution"
    finally:
        forget_echo_here()


def test_the_agent_serves_only_kinds_the_contract_declares() -> None:
    with pytest.raises(ValueError, match="no request model"):
        tools.register(Tool[EchoInput](kind="echo", run=run_echo))
    assert tools.get("echo") is None


if __name__ == "__main__":
    # The agent process of these tests (EchoAgent.launcher): echo registered, then the agent's command line.
    register_echo()
    if os.environ.get(FORGET) == "1":
        unregister_echo()
    sys.exit(cli.main())
