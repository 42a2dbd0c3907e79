"""Thin ctypes wrappers over the Linux calls isolation needs and Python 3.11 lacks.

`os.unshare`/`os.setns` arrived in Python 3.12; mount(2), pivot_root(2),
capset(2) and the capability-bounding prctl calls are in no version. Each
wrapper raises OSError with the kernel's errno, like the `os` functions do.
libc is loaded on first use, never at import.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

# sched.h
CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# sys/mount.h
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2

# linux/prctl.h
PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_SET_CHILD_SUBREAPER = 36
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

_LINUX_CAPABILITY_VERSION_3 = 0x20080522

SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
SYS_CAPSET = {"x86_64": 126, "aarch64": 91}
SYS_OPEN_TREE = 428  # the same on every architecture (Linux 5.2)
SYS_MOVE_MOUNT = 429
OPEN_TREE_CLONE = 1
AT_FDCWD = -100
MOVE_MOUNT_F_EMPTY_PATH = 0x4


@functools.cache
def libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str, path: str | None = None) -> int:
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}", path)
    return result


def _arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def unshare(flags: int) -> None:
    _check(libc().unshare(ctypes.c_int(flags)), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(libc().setns(ctypes.c_int(fd), ctypes.c_int(nstype)), "setns")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _check(libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           "mount", target)


def umount2(target: str, flags: int = 0) -> None:
    _check(libc().umount2(target.encode(), ctypes.c_int(flags)), "umount2", target)


def pivot_root(new_root: str, put_old: str) -> None:
    number = SYS_PIVOT_ROOT[_arch()]
    _check(libc().syscall(ctypes.c_long(number), new_root.encode(), put_old.encode()), "pivot_root", new_root)


def open_tree_clone(path: str) -> int:
    """A detached bind mount of `path` alone (O_PATH, close-on-exec): a descriptor whose `..`
    stops at `path`, since its mount has no parent. Needs CAP_SYS_ADMIN; Linux 5.2."""
    return _check(libc().syscall(ctypes.c_long(SYS_OPEN_TREE), ctypes.c_int(AT_FDCWD), path.encode(),
                                 ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC)), "open_tree", path)


def move_mount(fd: int, target: str) -> None:
    """Attach the detached mount `fd` (from `open_tree_clone`) at `target` in the caller's mount
    namespace. Needs CAP_SYS_ADMIN; Linux 5.2."""
    _check(libc().syscall(ctypes.c_long(SYS_MOVE_MOUNT), ctypes.c_int(fd), b"", ctypes.c_int(AT_FDCWD),
                          target.encode(), ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH)), "move_mount", target)


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(libc().sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(libc().prctl(ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3),
                               ctypes.c_ulong(arg4), ctypes.c_ulong(arg5)), "prctl")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 40


def restrict_capabilities(keep: set[int], last: int) -> None:
    """Drop every capability not in `keep` from the bounding, ambient, effective and
    permitted sets of the calling process, for good (no exec can bring them back)."""
    for cap in range(last + 1):
        if cap not in keep:
            prctl(PR_CAPBSET_DROP, cap)
    try:
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass
    mask = 0
    for cap in keep:
        mask |= 1 << cap
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)(_CapData(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0),
                          _CapData(mask >> 32, mask >> 32, 0))
    _check(libc().syscall(ctypes.c_long(SYS_CAPSET[_arch()]), ctypes.byref(header), data), "capset")


def loopback_up() -> None:
    """Bring `lo` up in a fresh network namespace (it starts down); the namespace has
    no other interface, so this gives sandboxed code 127.0.0.1 and nothing beyond."""
    import fcntl
    import socket
    import struct

    SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
