"""The agent's answers on the wire, byte for byte: status line, header names and order, body bytes.

The exec path is served ahead of FastAPI (docs/agent.md, "The exec fast path"),
and the other routes by FastAPI: these tests pin what both send, so neither can
drift from the other or from what the scheduler and clients parse. Raw HTTP/1.1
over the agent's Unix socket, so nothing a client library normalises is hidden.
"""

from __future__ import annotations

import json
import re
import socket

import pytest
from agent_harness import Agent, S


def raw(agent: Agent, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
        secret: str | None = "own") -> tuple[str, list[tuple[str, str]], bytes]:
    """One request on a fresh connection; (status line, headers without `date`, body)."""
    sent = {"host": "sandbox", "content-length": str(len(body)), **(headers or {})}
    if secret is not None:
        sent["authorization"] = f"Bearer {agent.secret if secret == 'own' else secret}"
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in sent.items()) + "\r\n"
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(agent.socket_path))
        s.sendall(head.encode() + body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        top, _, rest = data.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        pairs = [tuple(line.split(": ", 1)) for line in lines[1:]]
        length = int(dict((k.lower(), v) for k, v in pairs)["content-length"])
        while len(rest) < length:
            rest += s.recv(65536)
    return lines[0], [(k.lower(), v) for k, v in pairs if k.lower() != "date"], rest


def json_bytes(value: object) -> bytes:
    """How Starlette's JSONResponse renders a value."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()


@pytest.fixture
def uds_agent(agent: Agent) -> Agent:
    if agent.socket_path is None:
        pytest.skip("needs the agent on a Unix socket")
    return agent


def test_exec_answer_on_the_wire(uds_agent: Agent) -> None:
    body = json.dumps({"tool": "code_execution", "input": {"code": "print(1)"}, "tool_use_id": "toolu_wire"}).encode()
    status, headers, data = raw(uds_agent, "POST", f"{S}/exec", body, {"content-type": "application/json",
                                                                       "x-request-id": "wire-1"})
    assert status == "HTTP/1.1 200 OK"
    elapsed = json.loads(data)["execution_time_ms"]
    timeout = json.loads(data)["timeout_seconds"]
    assert data == json_bytes({
        "tool_use_id": "toolu_wire", "execution_time_ms": elapsed,
        "result_block": {"type": "code_execution_tool_result", "tool_use_id": "toolu_wire",
                         "content": {"type": "code_execution_result", "stdout": "1\n", "stderr": "",
                                     "return_code": 0, "content": []}},
        "timeout_seconds": timeout})
    assert headers == [("server", "uvicorn"), ("x-sandpool-outcome", "ok"), ("content-length", str(len(data))),
                       ("content-type", "application/json"), ("x-request-id", "wire-1")]


def test_bash_answer_with_a_produced_file_and_a_generated_id(uds_agent: Agent) -> None:
    body = json.dumps({"tool": "bash_code_execution", "input": {"command": "echo hi > made.txt; (exit 3)"}}).encode()
    status, headers, data = raw(uds_agent, "POST", f"{S}/exec", body)
    assert status == "HTTP/1.1 200 OK"
    answer = json.loads(data)
    assert re.fullmatch(r"srvtoolu_[0-9a-f]{24}", answer["tool_use_id"])
    assert data == json_bytes({
        "tool_use_id": answer["tool_use_id"], "execution_time_ms": answer["execution_time_ms"],
        "result_block": {"type": "bash_code_execution_tool_result", "tool_use_id": answer["tool_use_id"],
                         "content": {"type": "code_execution_result", "stdout": "", "stderr": "",
                                     "return_code": 3,
                                     "content": [{"type": "code_execution_output", "file_id": "made.txt",
                                                  "filename": "made.txt"}]}},
        "timeout_seconds": answer["timeout_seconds"]})
    assert [k for k, _ in headers] == ["server", "x-sandpool-outcome", "content-length", "content-type",
                                       "x-request-id"]
    assert dict(headers)["x-sandpool-outcome"] == "failed"


@pytest.mark.parametrize(("body", "status", "expected"), [
    (b"not json", "422 Unprocessable Entity",
     {"detail": "request body is not JSON", "reason": "invalid_request"}),
    (b'{"tool": "rm_rf", "input": {}}', "400 Bad Request", None),
    (b'{"tool": "code_execution", "input": {}}', "422 Unprocessable Entity", None),
])
def test_exec_refusals_on_the_wire(uds_agent: Agent, body: bytes, status: str, expected: object) -> None:
    got_status, headers, data = raw(uds_agent, "POST", f"{S}/exec", body, {"content-type": "application/json"})
    assert got_status == f"HTTP/1.1 {status}"
    answer = json.loads(data)
    assert data == json_bytes(answer)  # rendered by JSONResponse, whichever path answered
    if expected is not None:
        assert answer == expected
    assert answer["reason"] in ("invalid_request", "unknown_tool_kind")
    if answer["reason"] == "invalid_request" and expected is None:
        assert answer["detail"] == [{"loc": ["code_execution", "input", "code"], "msg": "Field required",
                                     "type": "missing"}]
    assert [k for k, _ in headers] == ["server", "content-length", "content-type", "x-request-id"]


def test_auth_and_size_refusals_on_the_wire(uds_agent: Agent) -> None:
    status, headers, data = raw(uds_agent, "POST", f"{S}/exec", b"{}", secret="wrong")
    assert status == "HTTP/1.1 401 Unauthorized"
    assert json.loads(data)["reason"] == "unauthorized" and data == json_bytes(json.loads(data))
    assert [k for k, _ in headers] == ["server", "www-authenticate", "content-length", "content-type",
                                       "x-request-id"]
    status, _, data = raw(uds_agent, "POST", f"{S}/exec", b"x" * 64,
                          {"content-length": str(1 << 40), "content-type": "application/json"})
    assert status == "HTTP/1.1 413 Request Entity Too Large"
    assert json.loads(data)["reason"] == "payload_too_large"


def test_other_routes_on_the_wire(uds_agent: Agent) -> None:
    status, headers, data = raw(uds_agent, "GET", "/healthz", secret=None)
    assert (status, data) == ("HTTP/1.1 200 OK", b'{"status":"ok"}')
    assert headers == [("server", "uvicorn"), ("content-length", "15"), ("content-type", "application/json"),
                       ("x-request-id", dict(headers)["x-request-id"])]
    status, _, data = raw(uds_agent, "GET", f"{S}/exec")
    assert status == "HTTP/1.1 405 Method Not Allowed"
    assert json.loads(data) == {"detail": "Method Not Allowed", "reason": "method_not_allowed"}
    status, _, data = raw(uds_agent, "POST", f"{S}/exec/more", b"{}")
    assert status == "HTTP/1.1 404 Not Found"
    assert json.loads(data) == {"detail": "Not Found", "reason": "not_found"}
    status, _, data = raw(uds_agent, "GET", f"{S}/files/list")
    assert status == "HTTP/1.1 200 OK" and "files" in json.loads(data)
