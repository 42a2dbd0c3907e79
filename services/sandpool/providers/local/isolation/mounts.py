"""The sandbox's filesystem: a new root built from read-only binds of the system.

Run inside the sandbox's own mount namespace (after `unshare(CLONE_NEWNS)` and,
for /proc, as a member of its own PID namespace). What the sandbox sees:

- `/usr`, `/bin`, `/lib*`, `/sbin`, `/etc` and the Python installation (plus the
  directory the sandpool package is imported from), read-only, nosuid, nodev, at
  the same paths as on the host so the interpreter finds its standard library;
- in `/etc`, the password hashes and host keys replaced by empty files;
- a fresh `/proc` (only the sandbox's own processes), `/proc/sys` read-only;
- a minimal `/dev` (null, zero, full, random, urandom, tty, fd links) and a
  size-capped `/dev/shm`;
- its own size-capped tmpfs `/tmp` and workspace (owned by the sandbox uid): the
  cap is the disk the sandbox can fill, and tmpfs pages count against the
  sandbox's memory cgroup;
- the agent's socket directory (the only path shared with the host);
- with egress, the egress proxy's Unix socket, read-only, at `EGRESS_SOCKET` in a
  directory only root (the agent, which relays to it) may enter;
- nothing else: no /home, /root, /work, /var, /run, /sys, no data dir, no other
  sandbox, no Redis files, no service secrets.

The new root is a small tmpfs made read-only once built; `pivot_root` swaps it in
and the old root is detached, so nothing of the host is reachable by path.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from . import linux

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
# Files under /etc that hold secrets of the host: hidden behind an empty file.
ETC_MASKED_FILES = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-",
                    "/etc/sudoers", "/etc/machine-id")
ETC_MASKED_DIRS = ("/etc/ssh", "/etc/ssl/private", "/etc/sudoers.d", "/etc/sandpool", "/etc/letsencrypt",
                   "/etc/kubernetes", "/etc/docker", "/etc/containerd", "/etc/redis", "/etc/wireguard",
                   "/etc/NetworkManager/system-connections", "/etc/pki/tls/private")
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")

WORKSPACE = "/workspace"
AGENT_DIR = "/run/sandpool"
EGRESS_DIR = "/run/sandpool-egress"
EGRESS_SOCKET = EGRESS_DIR + "/egress.sock"

RO = linux.MS_RDONLY | linux.MS_NOSUID | linux.MS_NODEV


@dataclass(frozen=True)
class RootPlan:
    """What to bind into every sandbox root; computed once by the zygote, host-side."""

    binds: tuple[str, ...]  # host directories bound read-only at the same path
    symlinks: tuple[tuple[str, str], ...]  # (path, target) recreated as in the host
    masked_files: tuple[str, ...]
    masked_dirs: tuple[str, ...]
    extra: tuple[str, ...] = field(default=())


def _covered(path: str, binds: list[str]) -> bool:
    return any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds)


def plan_root(extra_paths: tuple[str, ...] = (), *, exclude: tuple[str, ...] = ()) -> RootPlan:
    """The read-only view: system dirs, the Python prefixes, sys.path entries, extras.

    Nothing at or above an `exclude` path (the zygote's run directory) is bound.
    """
    binds: list[str] = []
    symlinks: list[tuple[str, str]] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            symlinks.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            binds.append(d)
    candidates = [sys.base_prefix, sys.prefix, sys.exec_prefix, *extra_paths]
    import sandpool

    candidates.append(str(Path(sandpool.__file__).resolve().parent.parent))
    candidates += [p for p in sys.path if p and os.path.isdir(p)]
    for c in candidates:
        real = os.path.realpath(c)
        if real in ("/", "") or _covered(real, binds) or not os.path.isdir(real):
            continue
        if any(_covered(real, [x]) or _covered(x, [real]) for x in exclude):
            continue
        # Never expose a parent of what is already bound (a sys.path entry of "/work").
        binds = [b for b in binds if not _covered(b, [real])] + [real]
    masked_files = tuple(p for p in ETC_MASKED_FILES if os.path.isfile(p))
    masked_dirs = tuple(p for p in ETC_MASKED_DIRS if os.path.isdir(p))
    return RootPlan(tuple(binds), tuple(symlinks), masked_files, masked_dirs)


@dataclass(frozen=True)
class SandboxFs:
    """Per-sandbox sizes and owners."""

    uid: int
    gid: int
    workspace_source: str | None  # host directory bound at WORKSPACE; None: a fresh tmpfs
    workspace_bytes: int
    tmp_bytes: int
    shm_bytes: int
    agent_dir: str | None  # host directory bound (read-write) at AGENT_DIR
    egress_socket: str | None = None  # host path of the egress proxy's socket, bound read-only at EGRESS_SOCKET


def _mkdirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def _touch(path: str) -> None:
    _mkdirs(os.path.dirname(path))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    os.close(fd)


def _bind_ro(src: str, dst: str, *, recursive: bool = True) -> None:
    linux.mount(src, dst, None, linux.MS_BIND | (linux.MS_REC if recursive else 0))
    linux.mount(None, dst, None, linux.MS_BIND | linux.MS_REMOUNT | RO)


def build_root(plan: RootPlan, fs: SandboxFs, new_root: str) -> None:
    """Build the sandbox root at `new_root` (an empty directory) and pivot into it.

    Must run in a private mount namespace; afterwards `/` is the sandbox root and the
    working directory is the workspace.
    """
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    linux.mount("sandpool-root", new_root, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=1m,mode=0755")
    r = new_root.rstrip("/")

    # /tmp first: sandpool itself may be installed under /tmp (a CI checkout, a venv there),
    # and its read-only binds must land inside the sandbox's own /tmp, not be hidden by it.
    _mkdirs(r + "/tmp")
    linux.mount("sandpool-tmp", r + "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"size={fs.tmp_bytes},mode=1777")

    for path, target in plan.symlinks:
        _mkdirs(os.path.dirname(r + path))
        os.symlink(target, r + path)
    for src in plan.binds:
        _mkdirs(r + src)
        _bind_ro(src, r + src)
    empty = r + "/.empty"  # an empty read-only file (a device node would not open on a nodev mount)
    os.close(os.open(empty, os.O_WRONLY | os.O_CREAT, 0o444))
    for path in plan.masked_files:
        if os.path.exists(r + path):
            linux.mount(empty, r + path, None, linux.MS_BIND)
            linux.mount(None, r + path, None, linux.MS_BIND | linux.MS_REMOUNT | RO)
    for path in plan.masked_dirs:
        if os.path.isdir(r + path):
            linux.mount("sandpool-mask", r + path, "tmpfs", RO, "size=4k,mode=0755")

    _mkdirs(r + "/proc")
    linux.mount("proc", r + "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    _bind_ro(r + "/proc/sys", r + "/proc/sys", recursive=False)

    dev = r + "/dev"
    _mkdirs(dev)
    linux.mount("sandpool-dev", dev, "tmpfs", linux.MS_NOSUID | linux.MS_NOEXEC, "size=64k,mode=0755")
    for node in DEV_NODES:
        if os.path.exists("/dev/" + node):
            _touch(f"{dev}/{node}")
            linux.mount("/dev/" + node, f"{dev}/{node}", None, linux.MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    _mkdirs(dev + "/shm")
    linux.mount("sandpool-shm", dev + "/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"size={fs.shm_bytes},mode=1777")
    linux.mount(None, dev, None, linux.MS_REMOUNT | linux.MS_NOSUID | linux.MS_NOEXEC | linux.MS_RDONLY,
                "size=64k,mode=0755")

    _mkdirs(r + WORKSPACE)
    if fs.workspace_source:
        # The provider's workspace (its own size-capped tmpfs when it runs as root).
        linux.mount(fs.workspace_source, r + WORKSPACE, None, linux.MS_BIND)
        linux.mount(None, r + WORKSPACE, None, linux.MS_BIND | linux.MS_REMOUNT | linux.MS_NOSUID | linux.MS_NODEV)
    else:
        linux.mount("sandpool-workspace", r + WORKSPACE, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                    f"size={fs.workspace_bytes},nr_inodes={max(1024, fs.workspace_bytes // 4096)},"
                    f"mode=0700,uid={fs.uid},gid={fs.gid}")
    if fs.agent_dir:
        _mkdirs(r + AGENT_DIR)
        linux.mount(fs.agent_dir, r + AGENT_DIR, None, linux.MS_BIND)
        linux.mount(None, r + AGENT_DIR, None,
                    linux.MS_BIND | linux.MS_REMOUNT | linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    if fs.egress_socket:
        # The socket file alone (never its host directory), read-only, where only root may reach it:
        # sandboxed code goes through the agent's relay, and the proxy checks its credential anyway.
        _mkdirs(r + EGRESS_DIR)
        os.chmod(r + EGRESS_DIR, 0o700)
        _touch(r + EGRESS_SOCKET)
        linux.mount(fs.egress_socket, r + EGRESS_SOCKET, None, linux.MS_BIND)
        linux.mount(None, r + EGRESS_SOCKET, None, linux.MS_BIND | linux.MS_REMOUNT | RO | linux.MS_NOEXEC)

    # Swap roots: pivot_root(".", ".") stacks the old root under the new one; detaching
    # it leaves no path back to the host tree.
    os.chdir(r)
    linux.pivot_root(".", ".")
    linux.umount2(".", linux.MNT_DETACH)
    os.chdir("/")
    linux.mount(None, "/", None, linux.MS_REMOUNT | RO, "size=1m,mode=0755")
    os.chdir(WORKSPACE)
