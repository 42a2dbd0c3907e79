"""Runners forked by the zygote's runner template (agent/runner_template.py) are the sandbox's own.

The template lives outside every sandbox, as root, and forks a runner into a sandbox through
its agent's PID descriptor. These tests hold such a runner against the shell, which the agent
starts itself with exec and its own hardening: the same namespaces, the same cgroup, the same
capabilities, no_new_privs, uid and seccomp filters, and nothing of the template's but the
five descriptors the agent sent. And a template that dies costs speed, never service.
"""

from __future__ import annotations

import json
import os
import resource
import signal
from collections.abc import Iterator

import pytest
from testkit import wait_for

from .harness import Harness

STATUS_KEYS = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs",
               "Seccomp", "Seccomp_filters")
NAMESPACES = ("mnt", "pid", "net", "ipc", "uts", "cgroup")

PYTHON_PROBE = f"""
import json, os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
fds = {{}}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{{fd}}")
    except OSError:
        pass
print(json.dumps({{
    "template": "--template" in open("/proc/self/cmdline", "rb").read().decode(errors="replace").split("\\0"),
    "ns": {{n: os.readlink(f"/proc/self/ns/{{n}}") for n in {NAMESPACES!r}}},
    "status": {{k: " ".join(status.get(k, "").split()) for k in {STATUS_KEYS!r}}},
    "cgroup": open("/proc/self/cgroup").read(), "fds": fds, "root": sorted(os.listdir("/")),
    "agent_filters": dict(line.split(":", 1) for line in open("/proc/1/status").read().splitlines())
                     .get("Seccomp_filters", "").strip(),
}}))
"""

SHELL_PROBE = (
    "for n in " + " ".join(NAMESPACES) + "; do echo \"ns $n $(readlink /proc/self/ns/$n)\"; done; "
    "grep -E '^(" + "|".join(STATUS_KEYS) + "):' /proc/self/status | sed 's/^/status /'; "
    "sed 's/^/cgroup /' /proc/self/cgroup; ls -A / | sed 's/^/root /'"
)


def shell_view(output: str) -> dict:
    view: dict = {"ns": {}, "status": {}, "cgroup": "", "root": []}
    for line in output.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "ns":
            name, _, link = rest.partition(" ")
            view["ns"][name] = link
        elif kind == "status":
            key, _, value = rest.partition(":")
            view["status"][key] = " ".join(value.split())
        elif kind == "cgroup":
            view["cgroup"] += rest + "\n"
        elif kind == "root":
            view["root"].append(rest)
    view["root"].sort()
    return view


def runner_view(sandbox) -> dict:
    result = sandbox.python(PYTHON_PROBE)
    assert result["return_code"] == 0, result
    return json.loads(result["stdout"])


def test_a_template_runner_is_confined_exactly_as_a_child_the_agent_starts(harness: Harness) -> None:
    sandbox = harness.start()
    try:
        runner = runner_view(sandbox)
        shell = sandbox.bash(SHELL_PROBE)
        assert shell["return_code"] == 0, shell
        child = shell_view(shell["stdout"])
        assert runner["template"], "the runner was not forked by the template"
        assert runner["ns"] == child["ns"]
        assert runner["status"] == child["status"]
        assert runner["status"]["Uid"] == " ".join([str(sandbox.uid)] * 4)
        assert runner["status"]["CapEff"] == "0000000000000000"
        # Under the agent's filter (the zygote's, this one), once: a second copy refuses nothing more.
        assert runner["status"]["Seccomp"] == "2"
        assert runner["status"]["Seccomp_filters"] == runner["agent_filters"] != ""
        assert runner["cgroup"] == child["cgroup"]  # the code cgroup's live generation
        assert runner["root"] == child["root"]
        # Nothing of the template's: its control socket, the other sandboxes' channels, pidfds and
        # cgroup files are all closed; the runner holds pipes, /dev/null and the probe's listing only.
        odd = {fd: target for fd, target in runner["fds"].items()
               if not (target.startswith("pipe:") or target == "/dev/null" or target.endswith("/fd"))}
        assert not odd, odd
    finally:
        harness.kill(sandbox)


def test_each_sandbox_gets_runners_in_its_own_namespaces(harness: Harness) -> None:
    first, second = harness.start(), harness.start()
    try:
        one, two = runner_view(first), runner_view(second)
        assert one["template"] and two["template"]
        assert all(one["ns"][name] != two["ns"][name] for name in NAMESPACES)
    finally:
        harness.kill(first)
        harness.kill(second)


def test_a_runner_s_exit_status_comes_back_through_the_template(harness: Harness) -> None:
    sandbox = harness.start()
    try:
        result = sandbox.python("import os; os._exit(7)")
        assert result["return_code"] == 7
        assert "exited with status 7" in result["stderr"]
        assert runner_view(sandbox)["template"]  # its replacement came from the template too
    finally:
        harness.kill(sandbox)


def children_of(pid: int) -> list[tuple[int, str]]:
    """(pid, state) of each child of `pid`, zombies included."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            found.append((int(entry), fields[0]))
    return found


def test_the_template_reaps_every_runner_it_forked(harness: Harness) -> None:
    sandbox = harness.start()
    try:
        for _ in range(4):
            assert sandbox.python("import os; os._exit(3)")["return_code"] == 3
        (template,) = harness.templates()
        # The live runner and its spare are the template's children; nothing else, no zombie above all.
        wait_for(lambda: len(children_of(template)) <= 2 and all(s != "Z" for _, s in children_of(template)),
                 timeout=10, what="only the live runner and its spare under the template",
                 state=lambda: children_of(template))
    finally:
        harness.kill(sandbox)
    wait_for(lambda: not children_of(template), timeout=10, what="no runner left once the sandbox is gone",
             state=lambda: children_of(template))


def test_a_dead_template_costs_speed_not_service(harness: Harness) -> None:
    sandbox = harness.start()
    try:
        assert runner_view(sandbox)["template"]
        (template,) = harness.templates()
        os.kill(template, signal.SIGKILL)
        # The live runner is the sandbox's; it serves on.
        assert sandbox.python("print(6 * 7)")["stdout"] == "42\n"
        # Its exit status had only the template to tell it (their parent): the agent still notices
        # the exit. The spare (forked before) takes over; the runners it starts now come from exec,
        # as without a template.
        for _ in range(2):
            assert "a new one was started" in sandbox.python("import os; os._exit(5)")["stderr"]
        assert runner_view(sandbox)["template"] is False
        # The next sandbox finds a new template.
        later = harness.start()
        try:
            assert runner_view(later)["template"]
            assert harness.templates() and harness.templates() != [template]
        finally:
            harness.kill(later)
    finally:
        harness.kill(sandbox)


def test_a_sandbox_whose_cgroup_files_did_not_reach_the_template_gets_runners_with_exec(harness: Harness) -> None:
    """Out of descriptors, the kernel cuts the tail off a message's descriptors (MSG_CTRUNC): a
    sandbox the template took without its cgroup files would get runners outside its memory and
    CPU groups. The template refuses such a sandbox, and its agent starts runners with exec.
    (Were the template to take it, the agent's cgroup check and the code cgroup's refusal of a
    process from outside the sandbox would each still keep such a runner from serving.)"""
    first = harness.start()  # the template is running
    (template,) = harness.templates()
    limit = resource.prlimit(template, resource.RLIMIT_NOFILE)
    try:
        held = {int(fd) for fd in os.listdir(f"/proc/{template}/fd")}
        free = [fd for fd in range(len(held) + 3) if fd not in held][:2]
        # Room for the next sandbox's channel and PID descriptor, not for its cgroup files.
        resource.prlimit(template, resource.RLIMIT_NOFILE, (free[1] + 1, limit[1]))
        sandbox = harness.start()
        try:
            runner = runner_view(sandbox)
            child = shell_view(sandbox.bash(SHELL_PROBE)["stdout"])
            assert runner["template"] is False
            assert runner["cgroup"] == child["cgroup"]
        finally:
            harness.kill(sandbox)
    finally:
        resource.prlimit(template, resource.RLIMIT_NOFILE, limit)
        harness.kill(first)
    later = harness.start()  # the template itself is fine, and serves the next sandbox
    try:
        assert runner_view(later)["template"]
    finally:
        harness.kill(later)


@pytest.fixture(scope="module")
def without_template() -> Iterator[Harness]:
    if os.geteuid() != 0:
        pytest.skip("isolation tests need root (namespaces, cgroups)")
    h = Harness(runner_template=False)
    yield h
    h.close()


def test_runners_start_with_exec_when_the_template_is_turned_off(without_template: Harness) -> None:
    sandbox = without_template.start()
    try:
        runner = runner_view(sandbox)
        assert runner["template"] is False
        assert not without_template.templates()
        shell = shell_view(sandbox.bash(SHELL_PROBE)["stdout"])
        assert runner["ns"] == shell["ns"] and runner["status"] == shell["status"]
    finally:
        without_template.kill(sandbox)
