"""The HTTP surface: auth, TCP and UDS, 400/422 bodies, one call at a time, start-up refusals, SIGTERM."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from agent_harness import REPO, Agent, S, content, start_agent
from testkit import scrubbed_env, survivors, wait_for


def test_auth_is_required_everywhere_but_healthz(agent: Agent) -> None:
    anon = agent.new_client(None)
    wrong = agent.new_client(agent.secret + "x")
    try:
        assert anon.get("/healthz").status_code == 200
        for client in (anon, wrong):
            for method, path in (("POST", f"{S}/exec"), ("GET", f"{S}/files/list"), ("GET", f"{S}/files?path=a"),
                                 ("POST", f"{S}/files")):
                resp = client.request(method, path, json={"tool": "bash_code_execution",
                                                          "input": {"command": "touch pwned"}})
                assert resp.status_code == 401, (method, path)
                assert resp.json()["reason"] == "unauthorized"
                assert resp.headers["www-authenticate"] == "Bearer"
        lower = agent.new_client(None)
        lower.headers["Authorization"] = f"bearer {agent.secret}x"
        assert lower.get(f"{S}/files/list").status_code == 401
        lower.close()
    finally:
        anon.close()
        wrong.close()
    assert not (agent.workspace / "pwned").exists()


def test_unknown_tool_is_400_and_malformed_bodies_are_422(agent: Agent) -> None:
    resp = agent.client.post(f"{S}/exec", json={"tool": "rm_rf", "input": {}})
    assert resp.status_code == 400 and resp.json()["reason"] == "unknown_tool_kind"
    for body in (b"not json", b"[]", b'{"tool": "code_execution"}', b'{"tool": "code_execution", "input": {}}',
                 b'{"tool": "code_execution", "input": {"code": ""}}', b'{"input": {"code": "1"}}',
                 b'{"tool": "bash_code_execution", "input": {"command": "x"}, "timeout_seconds": 0}'):
        resp = agent.client.post(f"{S}/exec", content=body, headers={"content-type": "application/json"})
        assert resp.status_code == 422, body
        assert resp.json()["reason"] == "invalid_request"
    assert content(agent.py("print('unharmed')"))["stdout"] == "unharmed\n"


def test_calls_run_one_at_a_time(agent: Agent) -> None:
    code = ("import time, os\nfd = os.open('order.log', os.O_WRONLY | os.O_APPEND | os.O_CREAT)\n"
            "os.write(fd, b'start\\n'); time.sleep(0.05); os.write(fd, b'end\\n'); os.close(fd)")
    bodies = [{"tool": "code_execution", "input": {"code": code}},
              {"tool": "bash_code_execution", "input": {"command": "echo start >> order.log; sleep 0.05; "
                                                                   "echo end >> order.log"}}] * 3
    statuses: list[int] = []

    def call(body: dict[str, object]) -> None:
        client = agent.new_client(agent.secret)
        statuses.append(client.post(f"{S}/exec", json=body).status_code)
        client.close()

    threads = [threading.Thread(target=call, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert statuses == [200] * 6
    lines = (agent.workspace / "order.log").read_text().split()
    assert lines == ["start", "end"] * 6


def test_tcp_listener_and_secret_file(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("file-secret\n")
    a = start_agent(tmp_path, "--secret-file", str(secret_file), uds=False, secret="env-secret-ignored")
    try:
        assert a.new_client("file-secret").get(f"{S}/files/list").status_code == 200
        assert a.client.get(f"{S}/files/list").status_code == 401  # the file wins over the environment
        ok = a.new_client("file-secret").post(f"{S}/exec", json={"tool": "code_execution",
                                                                 "input": {"code": "print(6*7)"}})
        assert content(ok.json())["stdout"] == "42\n"
    finally:
        a.stop()


def test_refuses_to_start_without_a_secret_or_workspace(tmp_path: Path) -> None:
    env = scrubbed_env()
    no_secret = subprocess.run([sys.executable, "-m", "sandpool", "agent", "--uds", str(tmp_path / "s.sock"),
                                "--workspace", str(tmp_path)], env=env, capture_output=True, text=True,
                               cwd=REPO, timeout=30)
    assert no_secret.returncode == 2
    assert "SANDPOOL_AGENT_SECRET" in no_secret.stderr
    assert not (tmp_path / "s.sock").exists()
    no_ws = subprocess.run([sys.executable, "-m", "sandpool", "agent", "--uds", str(tmp_path / "s.sock")],
                           env=env | {"SANDPOOL_AGENT_SECRET": "x"}, capture_output=True, text=True, cwd=REPO,
                           timeout=30)
    assert no_ws.returncode == 2 and "--workspace" in no_ws.stderr
    help_text = subprocess.run([sys.executable, "-m", "sandpool", "agent", "--help"], env=env,
                               capture_output=True, text=True, cwd=REPO, timeout=30).stdout
    assert "--secret-file" in help_text and "--agent-secret " not in help_text


def test_refuses_bad_limits_and_a_broken_interpreter(tmp_path: Path) -> None:
    env = scrubbed_env(SANDPOOL_AGENT_SECRET="x")
    (tmp_path / "ws").mkdir()
    base = [sys.executable, "-m", "sandpool", "agent", "--uds", str(tmp_path / "s.sock"), "--workspace",
            str(tmp_path / "ws")]
    ceiling = subprocess.run([*base, "--exec-timeout-seconds", "500", "--max-exec-timeout-seconds", "300"], env=env,
                             capture_output=True, text=True, cwd=REPO, timeout=30)
    assert ceiling.returncode == 2 and "max_exec_timeout_seconds" in ceiling.stderr
    broken = subprocess.run([*base, "--python-executable", str(tmp_path / "no-python")], env=env,
                            capture_output=True, text=True, cwd=REPO, timeout=30)
    assert broken.returncode != 0
    assert "interpreter failed to start" in broken.stderr
    assert not (tmp_path / "s.sock").exists()


def test_sigterm_kills_every_child_and_exits_promptly(tmp_path: Path) -> None:
    a = start_agent(tmp_path)
    try:
        tag = f"{random.randrange(10**6):06d}"
        result = a.sh(f"(setsid sleep 311.{tag} &); sleep 312 & echo $!")
        bg = int(content(result)["stdout"])
        pids = json.loads(content(a.py("import os, subprocess\n"
                                       "p = subprocess.Popen(['sleep', '313'])\n"
                                       "print([os.getpid(), p.pid])"))["stdout"])
        escaped = content(a.sh(f"pgrep -f 'sleep 311.{tag}'"))["stdout"].split()
        assert escaped
        holder: dict[str, object] = {}

        def long_call() -> None:
            try:
                code = "import time\nopen('started', 'w').close()\ntime.sleep(60)"
                holder["resp"] = a.client.post(f"{S}/exec", json={"tool": "code_execution", "input": {"code": code}})
            except Exception as exc:  # noqa: BLE001 - the connection may be cut at shutdown
                holder["error"] = exc

        t = threading.Thread(target=long_call)
        t.start()
        started = a.workspace / "started"
        wait_for(started.exists, timeout=10, interval=0.02, what="the long call started")
        a.proc.terminate()
        assert a.proc.wait(timeout=15) == 0
        t.join(timeout=15)
        assert not t.is_alive()
        assert survivors([bg, *pids, *map(int, escaped)], timeout=5.0) == []
    finally:
        a.stop()


@pytest.mark.parametrize("path", ["/healthz"])
def test_healthz_needs_no_secret_but_post_does(agent: Agent, path: str) -> None:
    anon = agent.new_client(None)
    try:
        assert anon.get(path).json() == {"status": "ok"}
        assert anon.post(path).status_code == 401
    finally:
        anon.close()
