"""The seccomp filter itself: its program, and what it refuses once installed.

Installing a filter needs no root (no_new_privs is enough), so these run anywhere
Linux runs; each installation happens in a forked child, never in pytest itself.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

import pytest
from testkit import in_forked_child

from sandpool.agent import seccomp

pytestmark = pytest.mark.skipif(sys.platform != "linux" or seccomp.native_arch() is None,
                                reason="seccomp filters are built for Linux x86_64/aarch64")


def in_filtered_child(body: str) -> dict[str, object]:
    """Fork, install the filter, run `body` (which sets `res`), return `res` via a pipe."""
    def run() -> object:
        scope: dict[str, object] = {"ctypes": ctypes, "errno": errno, "os": os}
        scope["installed"] = seccomp.install_filter()
        scope["libc"] = ctypes.CDLL(None, use_errno=True)
        exec(body, scope)  # test code of our own
        return scope["res"]

    result: dict[str, object] = in_forked_child(run)
    return result


def _call(expr: str) -> str:
    return (f"rc = {expr}\n"
            "res = [rc, errno.errorcode.get(ctypes.get_errno()) if rc == -1 else None, installed]\n")


@pytest.mark.parametrize("name, expr", [
    ("unshare", "libc.unshare(0x10000000)"),
    ("mount", "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)"),
    ("ptrace", "libc.ptrace(16, os.getppid(), 0, 0)"),
    ("keyctl", "libc.syscall(seccomp_nr('keyctl'), 0, 0, 0, 0)"),
    ("bpf", "libc.syscall(seccomp_nr('bpf'), 0, 0, 0)"),
    ("perf_event_open", "libc.syscall(seccomp_nr('perf_event_open'), 0, 0, 0, 0, 0)"),
    ("clone with CLONE_NEWUSER", "libc.syscall(CLONE, 0x10000000 | 17, 0, 0, 0, 0)"),
    ("clone with CLONE_NEWNET", "libc.syscall(CLONE, 0x40000000 | 17, 0, 0, 0, 0)"),
])
def test_refused_with_eperm(name: str, expr: str) -> None:
    arch = seccomp.native_arch()
    assert arch is not None
    numbers = {v: k for k, v in seccomp.denied_numbers(arch).items()}
    body = (f"CLONE = {seccomp.CLONE[arch]}\nseccomp_nr = lambda n: {numbers!r}[n]\n" + _call(expr))
    assert in_filtered_child(body) == [-1, "EPERM", True], name


def test_clone3_gets_enosys_so_libc_falls_back() -> None:
    res = in_filtered_child(_call(f"libc.syscall({seccomp.CLONE3}, 0, 0)"))
    assert res == [-1, "ENOSYS", True]


def test_ordinary_work_still_runs() -> None:
    body = (
        "import subprocess, threading, socket, tempfile\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "out = subprocess.run(['sh', '-c', 'echo hi'], capture_output=True, text=True).stdout\n"
        "a, b = socket.socketpair(); a.send(b'x')\n"
        "with tempfile.TemporaryFile() as f: f.write(b'data')\n"
        "status = open('/proc/self/status').read()\n"
        "res = [out, b.recv(1).decode(), 'Seccomp:\\t2' in status, 'NoNewPrivs:\\t1' in status, installed]\n")
    assert in_filtered_child(body) == ["hi\n", "x", True, True, True]


def test_program_checks_the_architecture_first_and_kills_foreign_calls() -> None:
    arch = seccomp.native_arch()
    assert arch is not None
    program = seccomp.build_program(arch)
    code, jt, jf, k = program[0]
    assert (code, k) == (seccomp.BPF_LD_W_ABS, seccomp.OFF_ARCH)
    code, jt, jf, k = program[1]
    assert code == seccomp.BPF_JEQ_K and k == seccomp.ARCHES[arch][1]
    assert program[1 + jf + 1] == (seccomp.BPF_RET_K, 0, 0, seccomp.SECCOMP_RET_KILL_PROCESS)
    # Every refused number appears once as a JEQ jumping to the EPERM return.
    eperm = program.index((seccomp.BPF_RET_K, 0, 0, seccomp.SECCOMP_RET_ERRNO | errno.EPERM))
    targets = {k for i, (c, jt, jf, k) in enumerate(program)
               if c == seccomp.BPF_JEQ_K and jt and i + jt + 1 == eperm}
    assert targets == set(seccomp.denied_numbers(arch))
    assert len(seccomp.program_bytes(arch)) == 8 * len(program)
    assert struct.unpack("=HBBI", seccomp.program_bytes(arch)[:8]) == program[0]


def test_both_tables_are_complete_for_the_core_calls() -> None:
    core = {"mount", "umount2", "pivot_root", "unshare", "setns", "ptrace", "process_vm_readv",
            "process_vm_writev", "kexec_load", "init_module", "finit_module", "delete_module", "bpf",
            "perf_event_open", "keyctl", "add_key", "request_key", "swapon", "swapoff", "reboot", "acct",
            "quotactl", "open_by_handle_at", "userfaultfd"}
    for arch in seccomp.ARCHES:
        names = set(seccomp.denied_numbers(arch).values())
        assert core <= names, (arch, core - names)
        assert seccomp.build_program(arch)[1][3] == seccomp.ARCHES[arch][1]
