"""A restart of the api or of the controller ends no session (DESIGN, "Components").

`sandpool up` as a user runs it: two sessions hold interpreter state, then each
service in turn is killed with SIGKILL (no chance to hand anything over); `up`
starts it again, and the same sessions still answer from the same interpreters.
Locally that means the zygote outlived the controller and the new controller
adopted it, sandboxes and all. Last, `up` itself is killed: the zygote it told
to end with it takes every sandbox along, so nothing is left running.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
from testkit import descendants, survivors, wait_for
from up_harness import Up


def _child(up: Up, command: str) -> int:
    """The pid of `sandpool <command>` among up's processes."""
    def found() -> list[int]:
        return [pid for pid in descendants(up.proc.pid)
                if f"sandpool\0{command}\0" in _cmdline(pid)]
    return wait_for(found, timeout=30, what=f"a running sandpool {command}")[0]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _run(client: httpx.Client, session: str, code: str) -> dict:
    answer = client.post(f"/sessions/{session}/exec", json={"tool": "code_execution", "input": {"code": code}})
    assert answer.status_code == 200, answer.text
    return answer.json()["result_block"]["content"]


def _answers_again(client: httpx.Client, session: str, code: str) -> dict:
    """The result of `code` once the api answers again (it may be starting)."""
    def attempt() -> dict | None:
        try:
            return _run(client, session, code)
        except httpx.TransportError:
            return None
    return wait_for(attempt, timeout=60, what="the api answering again")


def test_sessions_survive_kill_9_of_the_controller_then_of_the_api(up_factory) -> None:
    up: Up = up_factory()
    url, token = up.printed("SANDPOOL_URL="), up.printed("SANDPOOL_TOKEN=")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        sessions = [client.post("/sessions", json={}).json()["session_id"] for _ in range(2)]
        for n, session in enumerate(sessions):
            _run(client, session, f"x = {42 + n}")

        controller = _child(up, "controller")
        os.kill(controller, signal.SIGKILL)
        wait_for(lambda: "the controller exited (killed by SIGKILL); starting it again" in up.log_tail(),
                 timeout=30, what="up saying it restarts the controller")
        replacement = wait_for(lambda: [p for p in [_child(up, "controller")] if p != controller], timeout=30,
                               what="a new controller")[0]
        for n, session in enumerate(sessions):
            assert _answers_again(client, session, "print(x)")["stdout"] == f"{42 + n}\n"
        # The new controller serves the pool it adopted: a new session is leased and runs.
        fresh = client.post("/sessions", json={})
        assert fresh.status_code == 201, fresh.text
        assert _run(client, fresh.json()["session_id"], "print('fresh')")["stdout"] == "fresh\n"

        api = _child(up, "api")
        os.kill(api, signal.SIGKILL)
        for n, session in enumerate(sessions):
            assert _answers_again(client, session, "x += 1; print(x)")["stdout"] == f"{43 + n}\n"
        assert "the api exited (killed by SIGKILL); starting it again" in up.log_tail()
        assert _child(up, "controller") == replacement

    # The zygote is nobody's child now (its controller died): found by the socket it listens on, with
    # what it forked (which shares its command line).
    listen = str(Path((up.data_dir / "sockets").read_text().strip()) / "zygote.sock")
    zygote = {pid for pid in _all_pids() if "zygote_server" in _cmdline(pid) and listen in _cmdline(pid)}
    assert zygote
    sandboxes = set().union(*(descendants(pid) for pid in zygote))
    code, tree = up.stop(signal.SIGKILL)
    assert code == -signal.SIGKILL
    # No handler ran in up: the controller goes by its PDEATHSIG, the zygote by the pidfd of up it
    # watches, and the sandboxes with it.
    assert survivors(tree | zygote | sandboxes, timeout=30) == []


def _all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
