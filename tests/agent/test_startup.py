"""What an agent starts, and when: the interpreter before it serves, the shell on the first bash call."""

from __future__ import annotations

import os
import select
from pathlib import Path

import pytest
from agent_harness import content, start_agent
from pydantic import ValidationError

from sandpool.agent.settings import AgentSettings


def children(pid: int) -> list[str]:
    """Command names of the direct children of `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()
            if int(fields[1]) == pid:
                with open(f"/proc/{entry}/comm") as fh:
                    out.append(fh.read().strip())
        except (OSError, ValueError, IndexError):
            continue
    return out


def test_the_shell_starts_on_the_first_bash_call_and_keeps_its_state(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, "--no-spare-interpreter")
    try:
        assert "bash" not in children(agent.proc.pid)
        assert content(agent.py("print(1)"))["stdout"] == "1\n"
        assert "bash" not in children(agent.proc.pid)  # Python alone never starts it
        first = agent.sh("cd /tmp && export GREETING=hi && echo started")
        assert content(first)["stdout"] == "started\n"
        assert "shell_restarted" not in first  # a first start is not a restart
        assert children(agent.proc.pid).count("bash") == 1
        second = agent.sh("pwd; echo $GREETING")
        assert content(second)["stdout"] == "/tmp\nhi\n" and "shell_restarted" not in second
    finally:
        agent.stop()


def test_a_shell_that_cannot_run_stops_the_start(tmp_path: Path) -> None:
    agent = start_agent(tmp_path, "--shell", str(tmp_path / "no-bash"), wait=False)
    try:
        assert agent.proc.wait(timeout=30) != 0
        assert "is not an executable file" in agent.logs()
    finally:
        agent.stop()


def read_to_end(fd: int, timeout: float = 30.0) -> bytes:
    """All a pipe gives until every writer closed it; fails the test when one holds it past `timeout`."""
    data = b""
    while True:
        readable, _, _ = select.select([fd], [], [], timeout)
        assert readable, f"the pipe stayed open {timeout:g}s after {data!r}: a process still holds its write end"
        chunk = os.read(fd, 64)
        if not chunk:
            return data
        data += chunk


def test_the_agent_says_ok_on_its_ready_fd_once_it_serves_and_keeps_no_copy(tmp_path: Path) -> None:
    ready_r, ready_w = os.pipe()
    agent = start_agent(tmp_path, "--ready-fd", str(ready_w), wait=False, pass_fds=(ready_w,))
    os.close(ready_w)
    try:
        # "ok", then end-of-file: neither the agent nor its interpreter (started before) holds it open.
        assert read_to_end(ready_r) == b"ok"
        with agent.new_client(None) as client:  # no retry: the moment it said ok, it serves
            assert client.get("/healthz").status_code == 200
        assert content(agent.py("print(1)"))["stdout"] == "1\n"
    finally:
        os.close(ready_r)
        agent.stop()


def test_an_agent_that_cannot_start_closes_its_ready_fd_without_ok(tmp_path: Path) -> None:
    ready_r, ready_w = os.pipe()
    agent = start_agent(tmp_path, "--shell", str(tmp_path / "no-bash"), "--ready-fd", str(ready_w), wait=False,
                        pass_fds=(ready_w,))
    os.close(ready_w)
    try:
        assert read_to_end(ready_r) == b""
        assert agent.proc.wait(timeout=30) != 0
        assert "is not an executable file" in agent.logs()
    finally:
        os.close(ready_r)
        agent.stop()


def test_an_agent_nobody_waits_for_any_more_stops_instead_of_serving(tmp_path: Path) -> None:
    """Its launcher gave the start up, or was killed, before it could record the agent's pid: nothing
    would ever lease, find or destroy that sandbox, so the agent must not stay behind as an orphan."""
    ready_r, ready_w = os.pipe()
    agent = start_agent(tmp_path, "--ready-fd", str(ready_w), wait=False, pass_fds=(ready_w,))
    os.close(ready_w)
    os.close(ready_r)  # the launcher is gone before the agent serves
    try:
        assert agent.proc.wait(timeout=30) == 0
        assert "stopped waiting for this agent" in agent.logs()
    finally:
        agent.stop()


def test_settings_from_values_validate_like_the_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("SANDPOOL_")]:
        monkeypatch.delenv(name)
    values = {"agent_secret": "s" * 32, "uds": "/sandbox/agent/agent.sock", "workspace": "/workspace",
              "sandbox_uid": 1234, "exec_timeout_seconds": "5", "code_cgroup_fd": 7, "process_cap": 64}
    built = AgentSettings.from_values(**values)
    assert built == AgentSettings(**values)
    assert built.uds == Path("/sandbox/agent/agent.sock") and built.exec_timeout_seconds == 5.0
    for bad in ({"sandbox_uid": 0}, {"exec_timeout_seconds": 900}, {"sandbox_gid": 5}, {"code_cgroup_fd": 1},
                {"port": "many"}):
        with pytest.raises(ValidationError):
            AgentSettings.from_values(**{**values, "sandbox_uid": None, **bad} if "sandbox_gid" in bad
                                      else {**values, **bad})


def test_from_values_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDPOOL_MAX_OUTPUT_BYTES", "4096")
    assert AgentSettings().max_output_bytes == 4096  # the constructor reads it: the test can fail
    assert AgentSettings.from_values().max_output_bytes == AgentSettings.model_fields["max_output_bytes"].default
