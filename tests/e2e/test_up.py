"""`sandpool up` end to end: a real stack in subprocesses, driven over HTTP, then stopped.

What must hold: the SANDPOOL_URL line comes once the pool is warm; the contract works
through it; after SIGTERM no process the stack started is alive and no sandbox
directory is left.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from testkit import descendants, free_port, survivors, wait_for
from up_harness import assert_stopped_clean, exec_code, json_lines


def test_up_no_auth_serves_the_contract_and_stops_clean(up_factory) -> None:
    up = up_factory("--no-auth")
    url = up.printed("SANDPOOL_URL=")
    assert url == f"http://127.0.0.1:{up.port}"
    assert not any(line.startswith("SANDPOOL_TOKEN=") for line in up.lines)
    sandbox_dirs = list((up.data_dir / "sandboxes").iterdir())
    assert len(sandbox_dirs) >= 2  # warm before the URL was printed

    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        created = client.post("/sessions", json={})
        assert created.status_code == 201, created.text
        session = created.json()["session_id"]
        first = exec_code(client, session, "x = 41\nprint(1)")
        assert (first["stdout"], first["return_code"]) == ("1\n", 0)
        assert exec_code(client, session, "print(x + 1)")["stdout"] == "42\n"  # the session is stateful
        shell = client.post(f"/sessions/{session}/exec",
                            json={"tool": "bash_code_execution", "input": {"command": "echo hi"}})
        assert shell.status_code == 200 and shell.json()["result_block"]["content"]["stdout"] == "hi\n"
        put = client.post(f"/sessions/{session}/files", files={"file": ("note.txt", b"hello")})
        assert put.status_code == 201, put.text
        got = client.get(f"/sessions/{session}/files", params={"path": "note.txt"})
        assert got.status_code == 200 and got.content == b"hello"
        # Malformed input is refused clearly, and the session survives it.
        assert client.post(f"/sessions/{session}/exec", json={"tool": "no_such_tool", "input": {}}).status_code == 400
        assert client.post(f"/sessions/{session}/exec", json={"tool": "code_execution"}).status_code == 422
        assert client.post(f"/sessions/{session}/exec", content=b"{not json",
                           headers={"content-type": "application/json"}).status_code == 422
        assert exec_code(client, session, "print(x)")["stdout"] == "41\n"
        assert client.post("/sessions/nope/exec", json={"tool": "code_execution",
                                                        "input": {"code": "1"}}).status_code == 404
        assert client.delete(f"/sessions/{session}").status_code == 204
        assert client.post(f"/sessions/{session}/exec", json={"tool": "code_execution",
                                                               "input": {"code": "1"}}).status_code == 404
        # The released sandbox is replaced: the pool is warm again.
        second = client.post("/sessions", json={})
        assert second.status_code == 201
        assert exec_code(client, second.json()["session_id"], "print(2)")["stdout"] == "2\n"
    assert_stopped_clean(up)


def test_up_with_auth_prints_a_token_and_a_working_curl_line(up_factory) -> None:
    up = up_factory()
    url = up.printed("SANDPOOL_URL=")
    token = up.printed("SANDPOOL_TOKEN=")
    curl = "SID=" + up.printed("SID=")  # printed after the token line: wait for it too
    with httpx.Client(base_url=url, timeout=30) as client:
        assert client.post("/sessions", json={}).status_code == 401
        assert client.post("/sessions", json={}, headers={"Authorization": "Bearer not-a-jwt"}).status_code == 401
        created = client.post("/sessions", json={}, headers={"Authorization": f"Bearer {token}"})
        assert created.status_code == 201, created.text
    if shutil.which("curl"):
        result = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=60)
        assert '"stdout":"1\\n"' in result.stdout.replace(" ", ""), (result.stdout, result.stderr)
        # It cleans up after itself: the dev workspace holds only the session made above.
        with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"}) as client:
            live = client.get("/v1/sessions").json()["sessions"]
        assert [s["session_id"] for s in live] == [created.json()["session_id"]]
    assert_stopped_clean(up, signal.SIGINT)  # what Ctrl-C sends


def test_up_works_from_a_data_dir_of_any_length(up_factory, tmp_path: Path) -> None:
    long_dir = tmp_path / "a-rather-long-directory-name" / ("for-a-new-user-" * 6) / "sandpool" / ".sandpool"
    assert len(os.fsencode(long_dir)) >= 150
    up = up_factory(data_dir=long_dir)
    url, token = up.printed("SANDPOOL_URL="), up.printed("SANDPOOL_TOKEN=")
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"}) as client:
        sid = client.post("/sessions", json={}).json()["session_id"]
        assert exec_code(client, sid, "print(1)")["stdout"] == "1\n"
        assert client.delete(f"/sessions/{sid}").status_code == 204
    assert_stopped_clean(up)


def test_a_request_is_followed_through_api_and_agent_logs_by_its_id(up_factory) -> None:
    up = up_factory("--log-level", "info", "--agent-log-level", "info")  # agents log each call at info only
    url, token = up.printed("SANDPOOL_URL="), up.printed("SANDPOOL_TOKEN=")
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"}) as client:
        sid = client.post("/sessions", json={}).json()["session_id"]
        answer = client.post(f"/sessions/{sid}/exec", headers={"X-Request-Id": "follow-me-42"},
                             json={"tool": "bash_code_execution", "input": {"command": "echo traced"}})
        assert answer.status_code == 200 and answer.headers["x-request-id"] == "follow-me-42", answer.text
        generated = client.get(f"/sessions/{sid}/files/list").headers["x-request-id"]
        # The agent's log is in its sandbox's directory (the control plane's, mode 0600) until it goes.
        # Its access line is written once the answer is sent, so it may trail the answer a little.

        def agent_log() -> list[dict]:
            paths = (up.data_dir / "sandboxes").glob("*/agent.log")
            return [line for path in paths for line in json_lines(path.read_text(errors="replace"))]

        def agent_log_of_both() -> list[dict] | None:
            lines = agent_log()
            return lines if {"follow-me-42", generated} <= {line.get("request_id") for line in lines} else None

        agent_lines = wait_for(agent_log_of_both, timeout=10, what="the agent's access lines of both requests",
                               state=agent_log)
        assert client.delete(f"/sessions/{sid}").status_code == 204
    assert_stopped_clean(up)
    control_plane = json_lines((up.data_dir.parent / f"{up.data_dir.name}.log").read_text(errors="replace"))
    followed = [line for line in control_plane + agent_lines if line.get("request_id") == "follow-me-42"]
    # The request path is the api and the agent (the controller serves no request).
    assert {line["service"] for line in followed} == {"api", "agent"}, followed
    at_agent = [line for line in followed if line["service"] == "agent"]
    assert at_agent[0]["tool"] == "bash_code_execution" and at_agent[0]["outcome"] == "ok", at_agent
    at_api = [line for line in followed if line["service"] == "api" and line["msg"] == "request"]
    assert at_api[0]["tool"] == "bash_code_execution" and at_api[0]["outcome"] == "ok", at_api
    # An id the api generated is followed the same way; the token is in no line at all.
    assert {line["service"] for line in control_plane + agent_lines if line.get("request_id") == generated} \
        == {"api", "agent"}
    assert token.split(".")[2] not in json.dumps(control_plane + agent_lines)


@pytest.mark.parametrize(("args", "named"), [
    (["--pool-size", "-1"], "--pool-size"),
    (["--port", "http"], "--port"),
    (["--pool-size", "9", "--max-sandboxes", "3"], "pool_size exceeds max_sandboxes"),
    (["--redis-prefix", "bad prefix"], "--redis-prefix"),
])
def test_up_refuses_bad_flags_before_starting_anything(tmp_path: Path, args: list[str], named: str) -> None:
    data_dir = tmp_path / "never"
    result = subprocess.run([sys.executable, "-m", "sandpool", "up", "--no-auth", "--data-dir", str(data_dir),
                             *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert named in result.stderr and result.stdout == ""
    assert not data_dir.exists()


def test_up_with_an_external_redis_leaves_no_sandbox_records(up_factory, redis_url: str, redis_prefix: str) -> None:
    import redis as redis_sync

    from sandpool.state.keys import Keys

    up = up_factory("--no-auth", "--redis-url", redis_url, "--redis-prefix", redis_prefix)
    url = up.printed("SANDPOOL_URL=")
    keys = Keys(prefix=redis_prefix)
    client = redis_sync.Redis.from_url(redis_url, decode_responses=True)
    try:
        assert client.llen(keys.pool_ready("default")) >= 2
        with httpx.Client(base_url=url, timeout=30) as http:
            session = http.post("/sessions", json={}).json()["session_id"]  # left open on purpose
            assert exec_code(http, session, "print(1)")["stdout"] == "1\n"
        assert_stopped_clean(up)
        # Every sandbox record is forgotten and the open session released (metered once).
        assert client.scard(keys.pool_members("default")) == 0
        assert client.llen(keys.pool_ready("default")) == 0
        assert list(client.scan_iter(match=keys.sandbox_prefix + "*")) == []
        assert not client.exists(keys.session(session))
        assert client.zcard(keys.deadlines) == 0
    finally:
        for key in client.scan_iter(match=keys.base + "*"):
            client.delete(key)
        client.close()


def test_up_trusts_a_given_public_key_and_prints_no_token(up_factory, tmp_path: Path) -> None:
    from sandpool.edge.keys_cli import generate_keypair, mint_token

    private, public = generate_keypair(tmp_path / "key.pem")
    up = up_factory("--auth-public-key", str(public))
    url = up.printed("SANDPOOL_URL=")
    assert not any(line.startswith(("SANDPOOL_TOKEN=", "SID=")) for line in up.lines)
    token = mint_token(private, "team-a")
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/sessions", json={}).status_code == 401
        created = http.post("/sessions", json={}, headers={"Authorization": f"Bearer {token}"})
        assert created.status_code == 201, created.text
    assert_stopped_clean(up)


def test_a_killed_up_takes_its_stack_with_it(up_factory) -> None:
    up = up_factory("--no-auth")
    up.printed("SANDPOOL_URL=")
    tree = descendants(up.proc.pid)
    assert tree
    up.proc.kill()  # SIGKILL: no chance to clean up; the children must notice on their own
    up.proc.wait(10)
    assert survivors(tree, timeout=30) == []
    # Its socket directory outlived it (nothing could remove it); the next up on the data dir does.
    sockets = Path((up.data_dir / "run" / "sockets-dir").read_text())
    assert sockets.is_dir() and sockets.name.startswith("sandpool-up-")
    again = up_factory("--no-auth", data_dir=up.data_dir)
    again.printed("SANDPOOL_URL=")
    assert not sockets.exists()
    second = Path((up.data_dir / "run" / "sockets-dir").read_text())
    assert second.is_dir() and second != sockets
    assert_stopped_clean(again)  # a clean stop removes its directory and the note of it
    assert not second.exists() and not (up.data_dir / "run" / "sockets-dir").exists()


def test_a_second_up_on_the_same_data_dir_is_refused_and_touches_nothing(up_factory) -> None:
    first = up_factory("--no-auth")
    url = first.printed("SANDPOOL_URL=")
    sandboxes_before = sorted(p.name for p in (first.data_dir / "sandboxes").iterdir())
    result = subprocess.run(
        [sys.executable, "-m", "sandpool", "up", "--no-auth", "--port", str(free_port()),
         "--data-dir", str(first.data_dir), "--pool-size", "1", "--max-sandboxes", "2", "--log-level", "warning"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "another sandpool up is using" in result.stderr, result.stderr
    assert "SANDPOOL_URL" not in result.stdout
    # The first one lost nothing: its sandboxes are all there and it still serves.
    assert sorted(p.name for p in (first.data_dir / "sandboxes").iterdir()) == sandboxes_before
    with httpx.Client(base_url=url, timeout=30) as client:
        sid = client.post("/sessions", json={}).json()["session_id"]
        assert exec_code(client, sid, "print(6 * 7)")["stdout"] == "42\n"
    assert_stopped_clean(first)
