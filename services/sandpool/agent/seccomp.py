"""Seccomp filter for sandboxed code: refuse the system calls code execution never needs.

Why a deny-list and not an allow-list: the sandbox runs arbitrary Python, its C
extensions and whatever shell tools the image has, so the set of calls it may
legitimately make is open-ended; the set it never needs is small and is where
kernel attack surface and namespace escapes live (mounting, new namespaces,
tracing other processes, loading kernel code, keyrings, BPF, io_uring, which
bypasses seccomp for the operations it queues). Each of those gets EPERM, so a
program that merely probes fails cleanly instead of dying.

The filter checks the architecture field first: a call made through another ABI
(i386 `int 0x80` on x86_64, or the x32 ABI) would be judged against the wrong
syscall table, so it kills the process. `clone` is refused when it asks for a new
namespace; `clone3` passes its flags in memory a filter cannot read, so it gets
ENOSYS, which makes the C library fall back to `clone`.

Filters are inherited across fork and exec and cannot be removed. A process that
installed this filter itself (the zygote's sandbox, before it becomes the agent)
knows it (`inherited`), and its children add no copy of their own: a second
identical filter refuses nothing more and costs every system call of every
process below it a second run. An agent whose filter is someone else's (a
container runtime's profile on Kubernetes) does not know that, and its children
stack this one on top.
Only the standard library is used (ctypes), so the agent needs nothing extra.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import platform
import struct

# Kernel ABI constants (linux/seccomp.h, linux/filter.h, linux/audit.h, linux/prctl.h).
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
PR_GET_SECCOMP = 21
SECCOMP_MODE_FILTER = 2

SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
X32_SYSCALL_BIT = 0x40000000

BPF_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
BPF_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
BPF_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
BPF_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
BPF_RET_K = 0x06  # BPF_RET | BPF_K

# Offsets in struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6].
OFF_NR = 0
OFF_ARCH = 4
OFF_ARG0_LO = 16  # low 32 bits of args[0] (both supported arches are little-endian)

# Every namespace-creating clone flag (sched.h): CLONE_NEWTIME, NEWNS, NEWCGROUP,
# NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET.
CLONE_NAMESPACE_FLAGS = 0x00000080 | 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 \
    | 0x10000000 | 0x20000000 | 0x40000000

# Calls refused with EPERM. Numbers per ABI; a call an ABI lacks is simply absent.
DENIED: dict[str, tuple[int | None, int | None]] = {
    # name: (x86_64, aarch64)
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41), "chroot": (161, 51),
    "open_tree": (428, 428), "move_mount": (429, 429), "fsopen": (430, 430),
    "fsconfig": (431, 431), "fsmount": (432, 432), "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "unshare": (272, 97), "setns": (308, 268),
    "ptrace": (101, 117), "process_vm_readv": (310, 270), "process_vm_writev": (311, 271),
    "kcmp": (312, 272), "pidfd_getfd": (438, 438),
    "kexec_load": (246, 104), "kexec_file_load": (320, 294), "init_module": (175, 105),
    "finit_module": (313, 273), "delete_module": (176, 106), "create_module": (174, None),
    "get_kernel_syms": (177, None), "query_module": (178, None),
    "bpf": (321, 280), "perf_event_open": (298, 241), "userfaultfd": (323, 282),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89),
    "quotactl": (179, 60), "quotactl_fd": (443, 443),
    "open_by_handle_at": (304, 265), "name_to_handle_at": (303, 264),
    "lookup_dcookie": (212, 18), "syslog": (103, 116), "vhangup": (153, 58),
    "settimeofday": (164, 170), "clock_settime": (227, 112), "adjtimex": (159, 171),
    "clock_adjtime": (305, 266), "sethostname": (170, 161), "setdomainname": (171, 162),
    "iopl": (172, None), "ioperm": (173, None), "uselib": (134, None), "_sysctl": (156, None),
    "nfsservctl": (180, 42),
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426), "io_uring_register": (427, 427),
}
CLONE = {"x86_64": 56, "aarch64": 220}
CLONE3 = 435

ARCHES = {"x86_64": (0, AUDIT_ARCH_X86_64), "aarch64": (1, AUDIT_ARCH_AARCH64)}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def native_arch() -> str | None:
    """The ABI name the filter is built for, or None when this machine has no table here."""
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return machine if machine in ARCHES else None


def denied_numbers(arch: str) -> dict[int, str]:
    """Syscall number -> name of every call refused with EPERM on `arch`."""
    column = ARCHES[arch][0]
    denied: dict[int, str] = {}
    for name, numbers in DENIED.items():
        number = numbers[column]
        if number is not None:
            denied[number] = name
    return denied


def build_program(arch: str) -> list[tuple[int, int, int, int]]:
    """The classic-BPF program as (code, jt, jf, k) tuples, with jumps resolved."""
    return list(_program(arch))


@functools.cache
def _program(arch: str) -> tuple[tuple[int, int, int, int], ...]:
    """build_program's work, once per process: a forked sandbox installs what its zygote built.

    Layout: arch check, x32 check (x86_64), one JEQ per refused call jumping to the
    EPERM return, the clone flag check, then the returns.
    """
    audit_arch = ARCHES[arch][1]
    # Instructions with symbolic jump targets (labels) resolved in a second pass.
    prog: list[tuple[int, int | str, int | str, int]] = [
        (BPF_LD_W_ABS, 0, 0, OFF_ARCH),
        (BPF_JEQ_K, 0, "kill", audit_arch),
        (BPF_LD_W_ABS, 0, 0, OFF_NR),
    ]
    if arch == "x86_64":
        prog.append((BPF_JGE_K, "kill", 0, X32_SYSCALL_BIT))
    for number in sorted(denied_numbers(arch)):
        prog.append((BPF_JEQ_K, "eperm", 0, number))
    prog.append((BPF_JEQ_K, "enosys", 0, CLONE3))
    prog.append((BPF_JEQ_K, 0, "allow", CLONE[arch]))
    prog.append((BPF_LD_W_ABS, 0, 0, OFF_ARG0_LO))
    prog.append((BPF_JSET_K, "eperm", "allow", CLONE_NAMESPACE_FLAGS))
    labels = {"allow": len(prog), "eperm": len(prog) + 1, "enosys": len(prog) + 2, "kill": len(prog) + 3}
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW))
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM))
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | errno.ENOSYS))
    prog.append((BPF_RET_K, 0, 0, SECCOMP_RET_KILL_PROCESS))

    resolved = []
    for index, (code, jt, jf, k) in enumerate(prog):
        offsets: list[int] = []
        for target in (jt, jf):
            if isinstance(target, str):
                offset = labels[target] - index - 1
                if not 0 <= offset <= 255:
                    raise ValueError("seccomp program too long for an 8-bit jump")
                offsets.append(offset)
            else:
                offsets.append(target)
        resolved.append((code, offsets[0], offsets[1], k))
    return tuple(resolved)


def program_bytes(arch: str) -> bytes:
    """The program as the kernel reads it (struct sock_filter[]), for inspection and tests."""
    return b"".join(struct.pack("=HBBI", *insn) for insn in build_program(arch))


class _Installed:
    here = False
    """install_filter put this filter on this process, or on the process it is a fork of (memory
    and filters are inherited by a fork alike; an exec keeps the filter and forgets this)."""


def inherited() -> bool:
    """Whether this process runs under this module's filter, installed by itself or by the process
    it was forked from: its children then run under it too, whatever they do."""
    return _Installed.here


def install_filter() -> bool:
    """Install the filter in the calling process (and, through inheritance, its children).

    Sets no_new_privs first (the kernel requires it of a process without
    CAP_SYS_ADMIN, and a sandbox wants it anyway). Returns False when this
    machine's architecture or kernel cannot take the filter; raises nothing, so a
    caller decides whether a missing filter is fatal.
    """
    arch = native_arch()
    if arch is None:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    prctl = libc.prctl
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    insns = _program(arch)
    array = (_SockFilter * len(insns))(*(_SockFilter(*insn) for insn in insns))
    fprog = _SockFprog(len(insns), ctypes.cast(array, ctypes.POINTER(_SockFilter)))
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    if prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0) != 0:
        return False
    _Installed.here = True
    return True
