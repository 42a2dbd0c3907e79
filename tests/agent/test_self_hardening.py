"""The runner hardens itself (it is spawned without a `preexec_fn`, so with vfork) and the agent
believes /proc, not the runner: a runner that is not hardened as asked never runs a call."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from testkit import alive

from sandpool.agent import hardening, procs
from sandpool.agent.execution import ChildStartFailed
from sandpool.agent.interpreter import Interpreter

NOBODY = 65534


def policy(**fields: int | None) -> hardening.ChildPolicy:
    return hardening.ChildPolicy(**({"uid": None, "gid": None, "nproc": None, "nofile": 200, "fsize": None,
                                     "address_space": None} | fields))


@pytest.fixture
async def reaper() -> AsyncIterator[procs.ChildReaper]:
    reaper = procs.ChildReaper()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGCHLD, reaper.reap)
    yield reaper
    loop.remove_signal_handler(signal.SIGCHLD)


def interpreter(workspace: Path, reaper: procs.ChildReaper, harden, *, python: str = sys.executable) -> Interpreter:
    return Interpreter(python=python, workspace=str(workspace), env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                       harden=harden, child_reaper=reaper, max_output_bytes=1 << 16, grace_seconds=1.0, spare=False)


async def test_the_runner_applies_every_step_it_is_asked_for(tmp_path: Path, reaper: procs.ChildReaper) -> None:
    asked = policy(fsize=1 << 20, nofile=100)
    child = interpreter(tmp_path, reaper, lambda: hardening.self_hardening(asked, -1))
    await child.start()
    try:
        outcome = await child.run(
            "import json, resource\n"
            "status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
            "limit = resource.getrlimit\n"
            "print(json.dumps({k: status[k].split() for k in ('NoNewPrivs', 'Seccomp')} | {\n"
            "    'nofile': limit(resource.RLIMIT_NOFILE), 'core': limit(resource.RLIMIT_CORE),\n"
            "    'fsize': limit(resource.RLIMIT_FSIZE), 'environ': len(open('/proc/self/environ').read()) > 0}))",
            timeout=30)
    finally:
        await child.close()
    assert outcome.return_code == 0, outcome.stderr
    seen = json.loads(outcome.stdout)
    assert seen["NoNewPrivs"] == ["1"] and seen["Seccomp"] == ["2"]
    assert seen["nofile"] == [100, 100] and seen["core"] == [0, 0] and seen["fsize"] == [1 << 20, 1 << 20]
    assert seen["environ"]  # still dumpable: its own /proc files are its own


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
async def test_the_runner_drops_to_the_sandbox_uid_and_stays_dumpable(tmp_path: Path,
                                                                      reaper: procs.ChildReaper) -> None:
    tmp_path.chmod(0o777)
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    asked = policy(uid=NOBODY, gid=NOBODY, nproc=4096)
    child = interpreter(tmp_path, reaper, lambda: hardening.self_hardening(asked, -1), python=python)
    try:
        await child.start()
    except ChildStartFailed:
        pytest.skip(f"{python} cannot run as uid {NOBODY} on this host")
    try:
        outcome = await child.run("import os\nprint(os.getresuid(), os.getresgid(), os.getgroups(), "
                                  "len(os.listdir('/proc/self/fd')) > 0)", timeout=30)
    finally:
        await child.close()
    assert outcome.stdout == f"{(NOBODY,) * 3} {(NOBODY,) * 3} [] True\n", outcome.stderr


async def test_a_runner_that_cannot_harden_itself_never_reports_ready(tmp_path: Path,
                                                                      reaper: procs.ChildReaper) -> None:
    closed_fd = 1000  # the cgroup join must write to it, and cannot: the child keeps only the fds passed

    class NoFdToPass(hardening.SelfHardening):
        @property
        def pass_fds(self) -> tuple[int, ...]:
            return ()

    child = interpreter(tmp_path, reaper, lambda: NoFdToPass(policy(), closed_fd, b""))
    with pytest.raises(ChildStartFailed):
        await child.start()
    assert not [pid for pid in reaper.watched if alive(pid)]


async def test_the_agent_refuses_a_runner_that_proc_shows_unhardened(tmp_path: Path,
                                                                     reaper: procs.ChildReaper) -> None:
    """A runner that skipped its steps (here: asked for none) is caught by /proc before any call."""

    class Unasked(hardening.SelfHardening):
        def argv(self) -> list[str]:
            return []

    nofile_now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    expected = hardening.self_hardening(policy(uid=os.getuid() + 1, gid=os.getgid() + 1, nofile=nofile_now), -1)
    child = interpreter(tmp_path, reaper, lambda: Unasked(expected.policy, -1, expected.seccomp_program))
    with pytest.raises(ChildStartFailed):
        await child.start()
    assert not [pid for pid in reaper.watched if alive(pid)]


def test_verify_names_what_differs() -> None:
    """This test process has no filter and keeps its uid: each difference is named."""
    with pytest.raises(hardening.HardeningFailed, match="Uid"):
        hardening.self_hardening(policy(uid=os.getuid() + 1), -1).verify(os.getpid())
    with pytest.raises(hardening.HardeningFailed, match="cannot read"):
        hardening.self_hardening(policy(), -1).verify(2 ** 22 + 1)  # above pid_max: no such process


def test_the_spec_carries_only_the_steps_asked_for() -> None:
    (flag, spec) = hardening.SelfHardening(policy(nofile=None), -1, b"").argv()
    assert (flag, spec) == ("--harden", "")
    (_, spec) = hardening.SelfHardening(policy(uid=NOBODY, nproc=64, nofile=10, fsize=5, address_space=7), 9,
                                        b"\x01\x02").argv()
    assert dict(item.split("=") for item in spec.split(",")) == {
        "cgroup": "9", "uid": str(NOBODY), "gid": str(NOBODY), "nproc": "64", "nofile": "10", "fsize": "5",
        "as": "7", "seccomp": "0102"}
