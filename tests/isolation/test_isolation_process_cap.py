"""The process cap on sandboxed code's own cgroup, and the CPU quota of a sandbox (real zygote sandboxes).

A fork bomb fills the code's cap; it must never lock the session out: the agent
lives outside the capped group, and what a call that hit the cap started is
killed, while what calls under the cap left running lives on.
"""

from __future__ import annotations

import os
from pathlib import Path

from testkit import alive, wait_for

from .harness import Harness

BUSY = "fork: retry"
EAGAIN = "Resource temporarily unavailable"
NORMAL_CALL = "echo hi; ls / | wc -l; for i in 1 2 3 4; do (true); done; cat /proc/self/status | grep -c Pid"


def _normal_call_succeeds(sandbox) -> None:
    out = sandbox.bash(NORMAL_CALL, timeout=30)
    assert out["return_code"] == 0, out
    assert out["stdout"].startswith("hi\n"), out
    assert BUSY not in out["stderr"] and EAGAIN not in out["stderr"], out["stderr"][-500:]


def _code_tasks(harness: Harness, sandbox) -> int:
    code = harness.cgroup(sandbox, "pids") / "sandbox" / "code"
    return int((code / "pids.current").read_text())


def test_the_agent_is_outside_the_capped_code_group(harness: Harness) -> None:
    sandbox = harness.start(max_processes=32)
    top = harness.cgroup(sandbox, "pids")
    code = top / "sandbox" / "code"
    assert (code / "pids.max").read_text().strip() == "32"

    def members() -> set[int]:
        return {int(p) for g in code.glob("**/") for p in (g / "cgroup.procs").read_text().split()}

    # The interpreter, and its spare once that has started (in the background): the agent's children.
    wait_for(lambda: len(members()) >= 2, timeout=10, what="interpreter and spare in the code group", state=members)
    assert sandbox.handle.pid not in members()
    assert len([g for g in _generations(code).values() if g]) == 1  # both in the live generation
    agent_group = top / "sandbox" if (top / "sandbox" / "tasks").exists() else top / "sandbox" / "agent"
    assert sandbox.handle.pid in {int(p) for p in (agent_group / "cgroup.procs").read_text().split()}
    harness.kill(sandbox)


def _generations(code: Path) -> dict[int, set[int]]:
    """Generation number -> its member pids."""
    return {int(g.name[1:]): {int(p) for p in (g / "cgroup.procs").read_text().split()}
            for g in code.iterdir() if g.is_dir() and g.name[:1] == "g" and g.name[1:].isdigit()}


def test_every_interpreter_joins_the_live_generation_even_after_the_generation_changed(harness: Harness) -> None:
    """The agent moves each runner it starts into the live generation at once: after a call left
    something running (a new live generation), a restarted interpreter's new spare joins the
    interpreter there, not the leftover's generation. (Pids here are the host's: no sandbox view.)"""
    sandbox = harness.start(max_processes=32)
    code = harness.cgroup(sandbox, "pids") / "sandbox" / "code"
    # A sandbox's runner hardens itself here (a uid of its own, the zygote's filter on the agent).
    # (Forked by the zygote's runner template, or started with exec, `--harden` or `--template` shows.)
    hardened_itself = sandbox.python("args = open('/proc/self/cmdline').read().split(chr(0))\n"
                                     "print('--harden' in args or '--template' in args)")
    assert hardened_itself["stdout"] == "True\n", hardened_itself
    assert sandbox.python("import subprocess\nsubprocess.Popen(['sleep', '60'])")["return_code"] == 0

    def split_off() -> dict[int, set[int]] | None:
        found = _generations(code)
        return found if len(found) == 2 and [len(found[n]) for n in sorted(found)] == [1, 2] else None

    found = wait_for(split_off, timeout=10, what="the sleep left behind, interpreter and spare in a new generation",
                     state=lambda: _generations(code))
    live, interpreters = max(found), found[max(found)]
    assert sandbox.python("import os\nos._exit(3)")["return_code"] == 3  # the spare takes over; a new spare starts
    assert sandbox.python("print(1)")["stdout"] == "1\n"

    def new_spare_in_live() -> dict[int, set[int]] | None:
        found = _generations(code)
        return found if len(found.get(live, set())) == 2 and found[live] != interpreters else None

    found = wait_for(new_spare_in_live, timeout=10, what="the new spare in the live generation",
                     state=lambda: _generations(code))
    assert max(found) == live and all(len(found[n]) <= 1 for n in found if n != live)  # at most the sleep
    harness.kill(sandbox)


def test_a_bash_fork_bomb_then_a_normal_call_succeeds(harness: Harness) -> None:
    sandbox = harness.start(max_processes=32)
    sandbox.bash("export KEPT=yes; cd /tmp")
    # The classic: it returns at once and grows in the background.
    bomb = sandbox.bash(":(){ :|:& };:")
    assert bomb["return_code"] == 0
    for _ in range(3):
        _normal_call_succeeds(sandbox)
    assert sandbox.bash("echo $KEPT; pwd")["stdout"] == "yes\n/tmp\n"  # the same shell
    assert _code_tasks(harness, sandbox) < 16
    harness.kill(sandbox)


def test_a_foreground_bomb_is_killed_when_its_call_ends_and_the_interpreter_keeps_its_state(
        harness: Harness) -> None:
    sandbox = harness.start(max_processes=32)
    sandbox.python("kept = 41")
    response = sandbox.exec("code_execution", {"code": (
        "import os, time\n"
        "children = 0\n"
        "while True:\n"
        "    pid = os.fork()\n"  # raises BlockingIOError at the cap: the cell fails
        "    if pid == 0:\n"
        "        time.sleep(120)\n"
        "        os._exit(0)\n"
        "    children += 1\n")})
    result = response["result_block"]["content"]
    assert result["return_code"] == 1 and "BlockingIOError" in result["stderr"], result
    assert response["limit_exceeded"] == "processes"
    assert "process limit" in result["stderr"] and "interpreter_restarted" not in response
    # Its sleeping children are gone (and reaped: no zombie holds a slot of the cap).
    assert _code_tasks(harness, sandbox) < 8
    again = sandbox.python("import subprocess\nprint(kept + 1, subprocess.run(['true']).returncode)")
    assert again["stdout"] == "42 0\n", again
    _normal_call_succeeds(sandbox)
    harness.kill(sandbox)


def test_background_processes_of_calls_under_the_cap_live_on(harness: Harness) -> None:
    sandbox = harness.start(max_processes=32)
    server = sandbox.bash("sleep 300 & echo $!")["stdout"].strip()
    worker = sandbox.python("import subprocess\np = subprocess.Popen(['sleep', '301'])\nprint(p.pid)")
    worker = worker["stdout"].strip()
    sandbox.bash(":(){ :|:& };:")
    _normal_call_succeeds(sandbox)
    # One that hits the cap during its own call: what it started is killed when the call ends.
    held = sandbox.exec("bash_code_execution", {"command": (
        "python3 -c 'import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(120)\n"
        "        os._exit(0)\n'; echo after")})
    assert held["limit_exceeded"] == "processes", held
    assert held["result_block"]["content"]["stdout"] == "after\n"
    _normal_call_succeeds(sandbox)
    alive = sandbox.bash(f"kill -0 {server} && kill -0 {worker} && echo both alive")
    assert alive["stdout"] == "both alive\n", alive
    harness.kill(sandbox)


def test_a_fresh_shell_starts_after_a_bomb(harness: Harness) -> None:
    sandbox = harness.start(max_processes=32)
    sandbox.bash(":(){ :|:& };:")
    exited = sandbox.exec("bash_code_execution", {"command": "exit 7"})
    assert exited["result_block"]["content"]["return_code"] == 7 and exited["shell_restarted"] is True
    _normal_call_succeeds(sandbox)
    assert sandbox.healthy()
    harness.kill(sandbox)


def test_a_busy_loop_is_held_to_the_cpu_quota(harness: Harness) -> None:
    quota_cores = 0.25
    sandbox = harness.start(cpu_millis=int(quota_cores * 1000))
    cpu_group = harness.cgroup(sandbox, "cpu")
    if (cpu_group / "cpu.cfs_quota_us").exists():
        assert (cpu_group / "cpu.cfs_quota_us").read_text().strip() == "25000"
    else:
        assert (cpu_group / "cpu.max").read_text().split() == ["25000", "100000"]
    # Two spinning processes (this host has 2 cores) for two seconds of wall time: without a
    # quota they would take well over one core; under it, at most a quarter of one.
    out = sandbox.python(
        "import os, time\n"
        "wall = 2.0\n"
        "start = time.monotonic()\n"
        "pids = []\n"
        "for _ in range(2):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        while time.monotonic() - start < wall:\n"
        "            pass\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "for pid in pids:\n"
        "    os.waitpid(pid, 0)\n"
        "elapsed = time.monotonic() - start\n"
        "used = os.times().children_user + os.times().children_system\n"
        "print(used / elapsed)", timeout=30)
    share = float(out["stdout"])
    assert 0 < share <= quota_cores * 1.3 + 0.05, f"{share:.2f} cores used under a {quota_cores} core quota"
    stat = dict(line.split() for line in (cpu_group / "cpu.stat").read_text().splitlines())
    assert int(stat.get("nr_throttled", "0")) > 0, stat
    harness.kill(sandbox)


def test_a_sandbox_without_a_cpu_quota_is_not_throttled(harness: Harness) -> None:
    sandbox = harness.start()
    cpu_group = harness.cgroup(sandbox, "cpu")
    quota = cpu_group / "cpu.cfs_quota_us"
    if quota.exists():
        assert quota.read_text().strip() == "-1"
    else:
        assert (cpu_group / "cpu.max").read_text().split()[0] == "max"
    harness.kill(sandbox)


def test_killing_a_sandbox_removes_its_nested_groups(harness: Harness) -> None:
    sandbox = harness.start(max_processes=32)
    sandbox.bash("sleep 300 & echo started")  # leaves a second generation behind
    top = harness.cgroup(sandbox, "pids")
    groups = sorted(top.glob("**/"))
    assert len(groups) >= 5, groups  # <id>, sandbox, code, two generations
    members = {int(p) for g in groups for p in (g / "cgroup.procs").read_text().split()}
    harness.kill(sandbox)
    assert not top.exists()
    assert not any(alive(pid) for pid in members if pid != os.getpid())


def test_the_agents_cgroup_descriptor_cannot_climb_out_of_the_sandbox(harness: Harness) -> None:
    sandbox = harness.start(max_processes=32)
    agent = sandbox.handle.pid
    held = []
    for fd in os.listdir(f"/proc/{agent}/fd"):
        path = f"/proc/{agent}/fd/{fd}"
        if os.path.isdir(path) and "pids.max" in os.listdir(path) and "g1" in os.listdir(path):
            held.append(path)
    assert len(held) == 1, held
    code = held[0]
    # The descriptor's mount is `code/` alone: `..` ends there, so the group with the sandbox's
    # own limits (and every other group on the host) is out of reach of a compromised agent.
    assert sorted(os.listdir(f"{code}/..")) == sorted(os.listdir(code))
    assert sorted(os.listdir(f"{code}/../../..")) == sorted(os.listdir(code))
    assert (harness.cgroup(sandbox, "pids") / "sandbox" / "code" / "g1").is_dir()  # the same group
    # Sandboxed code holds no descriptor into cgroupfs at all.
    out = sandbox.python("import os\nlinks = set()\nfor fd in os.listdir('/proc/self/fd'):\n"
                         "    try:\n        links.add(os.readlink(f'/proc/self/fd/{fd}').split('[')[0])\n"
                         "    except OSError:\n        pass\nprint(sorted(links))")
    assert out["return_code"] == 0 and "pipe:" in out["stdout"], out
    assert "code" not in out["stdout"] and "cgroup" not in out["stdout"] and "/g" not in out["stdout"], out
    harness.kill(sandbox)
