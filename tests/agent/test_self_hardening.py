"""The runner that drops to a uid of its own hardens itself (it is spawned without a `preexec_fn`,
so with vfork), and the agent believes /proc, not the runner: a runner that is not hardened as
asked never runs a call. Interpreters run in `interpreter_driver.py`, never in pytest's process
(their kill path takes every other child of the process along)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from testkit import in_forked_child

from sandpool.agent import hardening, seccomp
from sandpool.agent.interpreter import runner_source

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")

NOBODY = 65534
DRIVER = Path(__file__).with_name("interpreter_driver.py")
POLICY = {"uid": NOBODY, "gid": NOBODY, "nproc": 4096, "nofile": 200, "fsize": None, "address_space": None}


def policy(**fields: int | None) -> hardening.ChildPolicy:
    return hardening.ChildPolicy(**(POLICY | fields))


def asked_of(child: hardening.ChildPolicy) -> hardening.SelfHardening:
    """What an agent under the zygote's seccomp filter asks (this test process has no filter)."""
    arch = seccomp.native_arch()
    if arch is None:
        pytest.skip("no seccomp filter for this architecture")
    return hardening.SelfHardening(child, seccomp.program_bytes(arch))


def python_for_nobody() -> str:
    """An interpreter uid 65534 can run (a root-only pyenv cannot): else the test cannot say anything."""
    for candidate in ("/usr/bin/python3", sys.executable):
        if subprocess.run([candidate, "-I", "-c", "import ctypes, json, traceback"], user=NOBODY, group=NOBODY,
                          extra_groups=[], cwd="/", capture_output=True, timeout=30).returncode == 0:
            return candidate
    pytest.skip(f"no Python on this host that uid {NOBODY} can run")


def drive(workspace: Path, harden: str, code: str = "pass", **policy_fields: int | None) -> dict:
    """Start an interpreter the way the agent does (`harden`: self, unasked or preexec) and run `code`."""
    workspace.chmod(0o777)
    config = {"python": python_for_nobody(), "workspace": str(workspace), "policy": POLICY | policy_fields,
              "harden": harden, "code": code}
    result = subprocess.run([sys.executable, str(DRIVER), json.dumps(config)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_runner_drops_its_uid_and_applies_every_step(tmp_path: Path) -> None:
    outcome = drive(tmp_path, "self", fsize=1 << 20, nofile=100, code=(
        "import builtins, json, os, resource, sys\n"
        "status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
        "limit = resource.getrlimit\n"
        "print(json.dumps({k: status[k].split() for k in ('NoNewPrivs', 'Seccomp', 'CapEff')} | {\n"
        "    'ids': [os.getresuid(), os.getresgid(), os.getgroups()],\n"
        "    'nofile': limit(resource.RLIMIT_NOFILE), 'core': limit(resource.RLIMIT_CORE),\n"
        "    'fsize': limit(resource.RLIMIT_FSIZE), 'environ': len(open('/proc/self/environ').read()) > 0,\n"
        "    'cmdline': '--harden' in open('/proc/self/cmdline').read().split(chr(0)),\n"
        "    'site': [sys.flags.no_site, 'site' in sys.modules, hasattr(builtins, 'exit')]}))"))
    assert outcome["started"] and outcome["return_code"] == 0, outcome
    seen = json.loads(outcome["stdout"])
    assert seen["ids"] == [[NOBODY] * 3, [NOBODY] * 3, []]
    assert seen["NoNewPrivs"] == ["1"] and seen["Seccomp"] == ["2"] and seen["CapEff"] == ["0" * 16]
    assert seen["nofile"] == [100, 100] and seen["core"] == [0, 0] and seen["fsize"] == [1 << 20, 1 << 20]
    # Dumpable again once hardened: after a uid change its own /proc/self/environ would be root's.
    assert seen["environ"] and seen["cmdline"] and not outcome["preexec_ran"]
    # Started with -S: the environment's site start-up ran only once hardened, and did run.
    assert seen["site"] == [1, True, True]


def test_without_self_hardening_the_runner_is_hardened_before_exec(tmp_path: Path) -> None:
    """No SelfHardening (none without a uid drop, or without the agent's filter: below): the
    `preexec_fn` hardens the child between fork and exec, and no `--harden` is passed."""
    outcome = drive(tmp_path, "preexec", code="print('--harden' in open('/proc/self/cmdline').read().split(chr(0)))")
    assert outcome["started"] and outcome["stdout"] == "False\n" and outcome["preexec_ran"], outcome


def test_only_an_agent_under_a_filter_asks_the_runner_to_harden_itself() -> None:
    """Unfiltered (this process; a host without the seccomp layer) the kernel may refuse a filter,
    which `apply` tolerates: the runner is then hardened before exec, as it always was."""
    if Path("/proc/self/status").read_text().count("Seccomp:\t0") == 1:  # this test process: unfiltered
        assert hardening.self_hardening(policy(), sys.executable) is None
    shim = Path(__file__).with_name("conftest.py")  # any file that is not a binary
    code = ("import sys\nfrom sandpool.agent import hardening, seccomp\n"
            "assert seccomp.install_filter()\n"
            f"p = hardening.ChildPolicy({NOBODY}, {NOBODY}, None, 100, None, None)\n"
            "print(type(hardening.self_hardening(p, sys.executable)).__name__,"
            " hardening.self_hardening(hardening.ChildPolicy(None, None, None, 100, None, None), sys.executable),"
            f" hardening.self_hardening(p, {str(shim)!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout == "SelfHardening None None\n", result.stderr


def test_only_a_binary_interpreter_starts_a_self_hardening_runner(tmp_path: Path) -> None:
    """A script (a pyenv shim reads `.python-version` in its working directory, the workspace) would
    run as the agent's user before any hardening: such an interpreter is hardened before exec."""
    shim = tmp_path / "python"
    shim.write_text("#!/bin/sh\nexec /usr/bin/python3 \"$@\"\n")
    shim.chmod(0o755)
    assert not hardening.is_binary(str(shim))
    assert not hardening.is_binary(str(tmp_path / "missing"))
    assert hardening.is_binary(sys.executable)


def test_a_runner_that_cannot_harden_itself_exits_before_it_is_ready() -> None:
    """A step that fails ends the runner with 126 and a line saying so, before it reads a request."""
    for spec in ("uid=notanumber,gid=1", "uid=65534,gid=65534,nofile=-5", "uid=65534,gid=65534,seccomp=00"):
        result = subprocess.run([sys.executable, "-I", "-c", runner_source(), "--harden", spec, "3", "4"],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 126, (spec, result.stderr)
        assert result.stderr.startswith("sandpool runner: cannot harden itself:"), (spec, result.stderr)


def test_the_agent_refuses_a_runner_that_proc_shows_unhardened(tmp_path: Path) -> None:
    """A runner that skipped its steps (asked for none, spawned with no `preexec_fn`) is caught by /proc
    before any call, and nothing of it is left running."""
    outcome = drive(tmp_path, "unasked", code="print('ran')")
    assert outcome == {"started": False, "left": []}


def test_verify_names_every_difference() -> None:
    """This test process keeps root's ids and capabilities, and not the asked limit: each is named."""
    asked = asked_of(policy(nofile=resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1))
    with pytest.raises(hardening.HardeningFailed) as failed:
        asked.verify(os.getpid())
    for name in ("Uid", "Gid", "CapEff", "limit nofile"):
        assert name in str(failed.value)
    with pytest.raises(hardening.HardeningFailed, match="cannot read"):
        asked.verify(2 ** 22 + 1)  # above pid_max: no such process


def test_the_spec_carries_only_the_steps_asked_for() -> None:
    (flag, spec) = hardening.SelfHardening(policy(nproc=None, nofile=None), b"").argv()
    assert (flag, spec) == ("--harden", f"uid={NOBODY},gid={NOBODY}")
    (_, spec) = hardening.SelfHardening(policy(gid=None, nproc=64, nofile=10, fsize=5, address_space=7),
                                        b"\x01\x02").argv()
    assert dict(item.split("=") for item in spec.split(",")) == {
        "uid": str(NOBODY), "gid": str(NOBODY), "nproc": "64", "nofile": "10", "fsize": "5", "as": "7",
        "seccomp": "0102"}
    (_, spec) = hardening.SelfHardening(policy(), b"\x01\x02", inherited=True).argv()
    assert "seccomp" not in dict(item.split("=") for item in spec.split(","))  # under it already


def _filters_after_apply(foreign: bool) -> list[int]:
    """In a forked child: a filter (this module's, or another one) on the 'agent', then `apply` in a
    fork of it; [the agent's Seccomp_filters, the child's]."""
    def filters() -> int:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(status["Seccomp_filters"])

    def agent() -> list[int]:
        if foreign:  # a filter seccomp.py did not install (a container runtime's profile): allow all
            import ctypes

            from sandpool.agent.runner import _install_filter
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.prctl(38, 1, 0, 0, 0) == 0
            _install_filter(libc, seccomp.struct.pack("=HBBI", seccomp.BPF_RET_K, 0, 0, seccomp.SECCOMP_RET_ALLOW))
        else:
            assert seccomp.install_filter()
        own = filters()

        def child() -> list[int]:
            hardening.apply(policy(uid=None, gid=None, nproc=None, nofile=None))
            return [own, filters()]

        answer: list[int] = in_forked_child(child)
        return answer

    result: list[int] = in_forked_child(agent)
    return result


def test_a_child_adds_this_filter_only_where_the_agent_s_is_another() -> None:
    """Under this module's filter (the zygote's agent), a child is under it from its fork: a second
    copy would refuse nothing more. Under another filter (a container runtime's), it adds this one."""
    if seccomp.native_arch() is None or "Seccomp_filters" not in Path("/proc/self/status").read_text():
        pytest.skip("no seccomp filter for this architecture, or no Seccomp_filters in /proc")
    agent, child = _filters_after_apply(foreign=False)
    assert child == agent
    agent, child = _filters_after_apply(foreign=True)
    assert child == agent + 1
