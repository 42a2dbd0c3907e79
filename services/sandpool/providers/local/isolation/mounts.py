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
    working directory is the workspace. (`prepare_template` and `finish_root` do the same in
    two steps: the shared part once per zygote, the sandbox's own part per sandbox.)
    """
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    r = new_root.rstrip("/")
    _shared_tree(plan, r, per_sandbox_tmp=fs.tmp_bytes)
    _own_mounts(plan, fs, r, HeldMounts(), binds_under_tmp=False)
    _pivot(r)
    linux.mount(None, "/", None, linux.MS_REMOUNT | RO, "size=1m,mode=0755")
    os.chdir(WORKSPACE)


# -- one root for every sandbox of a zygote ------------------------------------------------------
#
# The read-only part of the root (the root tmpfs, the system binds, the masks, /dev's nodes) is the
# same for every sandbox, and building it is ~25 mount calls and five tmpfs superblocks. The zygote
# builds it once, in a mount namespace of its own (the template namespace), made read-only at the
# superblock: no sandbox, whatever its capabilities, can write into it. A sandbox joins that
# namespace and unshares it, which copies the whole tree in the kernel; then it mounts its own
# writable parts (/tmp, /dev/shm, the workspace, a /proc of its PID namespace) and the host paths
# it is given (the agent's socket directory, the egress socket, a provider's workspace), and pivots.
# What a sandbox writes lands only in mounts of its own; tests/isolation/test_isolation_template.py
# plants markers in one sandbox and looks for them from the next.

TEMPLATE_MARK = "/.empty"
"""A file only the template root has: its presence in a sandbox's copy says the template is whole."""


@dataclass
class HeldMounts:
    """Detached copies (`open_tree` descriptors) of the host paths a sandbox is given, taken in the
    host's mount namespace before the sandbox leaves it for the template's: paths mounted on the
    host after the template was made (a provider's size-capped workspace) are not in the template."""

    workspace: int | None = None
    agent_dir: int | None = None
    egress_socket: int | None = None

    def close(self) -> None:
        for fd in (self.workspace, self.agent_dir, self.egress_socket):
            if fd is not None:
                os.close(fd)
        self.workspace = self.agent_dir = self.egress_socket = None


def prepare_template(plan: RootPlan, new_root: str) -> int:
    """Build the shared, read-only part of every sandbox root at `new_root`, in a new mount
    namespace; returns a descriptor of that namespace (close-on-exec). The caller stays in its own.

    The caller must be single-threaded (setns of a mount namespace) and hold CAP_SYS_ADMIN."""
    host = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    cwd = os.getcwd()
    try:
        linux.unshare(linux.CLONE_NEWNS)
        try:
            linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
            r = new_root.rstrip("/")
            _shared_tree(plan, r, per_sandbox_tmp=None)
            _mkdirs(r + WORKSPACE)
            _mkdirs(r + AGENT_DIR)
            _mkdirs(r + EGRESS_DIR)
            os.chmod(r + EGRESS_DIR, 0o700)
            _touch(r + EGRESS_SOCKET)
            linux.mount(None, r, None, linux.MS_REMOUNT | RO, "size=1m,mode=0755")
            _prune_host_copies(r, [b for b in plan.binds if _covered(b, ["/tmp"])])
            return os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            try:
                linux.setns(host, linux.CLONE_NEWNS)
            except OSError:  # pragma: no cover - setns to a namespace we hold cannot fail
                os._exit(70)  # the zygote must never go on in the template's namespace
            os.chdir(cwd)
    finally:
        os.close(host)


# Host mounts the template namespace keeps (its copies of them): what a sandbox still reaches by path
# before it pivots (cgroup files, the sources of binds under /tmp). Its copies of every other host
# mount are detached: the namespace lives as long as the zygote, and a copy would pin what the host
# unmounts meanwhile (another installation's workspace tmpfs, with its files, or a network namespace).
_KEPT_HOST_MOUNTS = ("/", "/tmp")
_KEPT_HOST_TREES = ("/proc", "/sys", "/dev")


def _prune_host_copies(r: str, reached: list[str]) -> None:
    """In the template namespace: detach the copies of host mounts a sandbox does not need (deepest first):
    all but the kept ones, the template's own tree, and those on the way to it or to a path in `reached`."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as info:
        for line in info:
            field = line.split(" ", 5)[4]
            point = field.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")
            if point in _KEPT_HOST_MOUNTS or _covered(point, [*_KEPT_HOST_TREES, r]) \
                    or any(_covered(path, [point]) for path in (r, *reached)):
                continue
            points.append(point)
    for point in sorted(set(points), key=lambda p: -p.count("/")):
        try:
            linux.umount2(point, linux.MNT_DETACH)
        except OSError:
            pass  # gone with its parent already


def hold_host_paths(fs: SandboxFs) -> HeldMounts:
    """Detached copies of the host paths `fs` names (see HeldMounts); call in the host's namespace."""
    held = HeldMounts()
    try:
        if fs.workspace_source:
            held.workspace = linux.open_tree_clone(fs.workspace_source)
        if fs.agent_dir:
            held.agent_dir = linux.open_tree_clone(fs.agent_dir)
        if fs.egress_socket:
            held.egress_socket = linux.open_tree_clone(fs.egress_socket)
    except BaseException:
        held.close()
        raise
    return held


def enter_template(template_ns: int) -> None:
    """Join the template's mount namespace, then leave it for a copy of our own (with the other
    namespaces the caller unshares next: CLONE_NEWNS must be among them)."""
    linux.setns(template_ns, linux.CLONE_NEWNS)


def finish_root(plan: RootPlan, fs: SandboxFs, new_root: str, held: HeldMounts) -> None:
    """In the sandbox's own copy of the template's namespace: mount its own parts and pivot into the
    root. Afterwards `/` is the sandbox root (read-only) and the working directory the workspace."""
    r = new_root.rstrip("/")
    linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
    if not os.path.ismount(r) or not os.path.isfile(r + TEMPLATE_MARK):
        raise RuntimeError("the zygote's prepared root is gone (its mount point was removed)")
    _mount_tmp(r, fs.tmp_bytes)
    _own_mounts(plan, fs, r, held, binds_under_tmp=True)
    _pivot(r)
    os.chdir(WORKSPACE)


# -- the parts -------------------------------------------------------------------------------------

def _mount_tmp(r: str, size: int) -> None:
    _mkdirs(r + "/tmp")
    linux.mount("sandpool-tmp", r + "/tmp", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, f"size={size},mode=1777")


def _shared_tree(plan: RootPlan, r: str, *, per_sandbox_tmp: int | None) -> None:
    """The root tmpfs, the system's read-only binds, the masks, /proc's mount point and /dev (read-only,
    with /dev/shm's mount point). With `per_sandbox_tmp` (the one-step build) the sandbox's /tmp is
    mounted first and the binds under /tmp land inside it; without, binds under /tmp are left out
    (each sandbox makes them inside its own /tmp: `_own_mounts`)."""
    linux.mount("sandpool-root", r, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV, "size=1m,mode=0755")
    if per_sandbox_tmp is not None:
        # /tmp first: sandpool itself may be installed under /tmp (a CI checkout, a venv there),
        # and its read-only binds must land inside the sandbox's own /tmp, not be hidden by it.
        _mount_tmp(r, per_sandbox_tmp)
    else:
        _mkdirs(r + "/tmp")
    for path, target in plan.symlinks:
        _mkdirs(os.path.dirname(r + path))
        os.symlink(target, r + path)
    for src in plan.binds:
        if per_sandbox_tmp is None and _covered(src, ["/tmp"]):
            continue
        _mkdirs(r + src)
        _bind_ro(src, r + src)
    empty = r + TEMPLATE_MARK  # an empty read-only file (a device node would not open on a nodev mount)
    os.close(os.open(empty, os.O_WRONLY | os.O_CREAT, 0o444))
    for path in plan.masked_files:
        if os.path.exists(r + path):
            linux.mount(empty, r + path, None, linux.MS_BIND)
            linux.mount(None, r + path, None, linux.MS_BIND | linux.MS_REMOUNT | RO)
    for path in plan.masked_dirs:
        if os.path.isdir(r + path):
            linux.mount("sandpool-mask", r + path, "tmpfs", RO, "size=4k,mode=0755")
    _mkdirs(r + "/proc")

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
    linux.mount(None, dev, None, linux.MS_REMOUNT | linux.MS_NOSUID | linux.MS_NOEXEC | linux.MS_RDONLY,
                "size=64k,mode=0755")


def _attach(source: str | int, target: str, flags: int) -> None:
    """Bind host path `source`, or attach the held copy `source`, at `target`; then remount it with `flags`."""
    if isinstance(source, int):
        linux.move_mount(source, target)
    else:
        linux.mount(source, target, None, linux.MS_BIND)
    linux.mount(None, target, None, linux.MS_BIND | linux.MS_REMOUNT | flags)


def _own_mounts(plan: RootPlan, fs: SandboxFs, r: str, held: HeldMounts, *, binds_under_tmp: bool) -> None:
    """The sandbox's own mounts over the shared tree: binds under its /tmp (when the tree left them
    out), its /proc, /dev/shm, workspace, the agent's socket directory and the egress socket."""
    if binds_under_tmp:
        for src in plan.binds:
            if _covered(src, ["/tmp"]):
                _mkdirs(r + src)
                _bind_ro(src, r + src)
    linux.mount("proc", r + "/proc", "proc", linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    _bind_ro(r + "/proc/sys", r + "/proc/sys", recursive=False)
    linux.mount("sandpool-shm", r + "/dev/shm", "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                f"size={fs.shm_bytes},mode=1777")

    _mkdirs(r + WORKSPACE)
    if fs.workspace_source:
        # The provider's workspace (its own size-capped tmpfs when it runs as root).
        _attach(held.workspace if held.workspace is not None else fs.workspace_source, r + WORKSPACE,
                linux.MS_NOSUID | linux.MS_NODEV)
    else:
        linux.mount("sandpool-workspace", r + WORKSPACE, "tmpfs", linux.MS_NOSUID | linux.MS_NODEV,
                    f"size={fs.workspace_bytes},nr_inodes={max(1024, fs.workspace_bytes // 4096)},"
                    f"mode=0700,uid={fs.uid},gid={fs.gid}")
    if fs.agent_dir:
        _mkdirs(r + AGENT_DIR)
        _attach(held.agent_dir if held.agent_dir is not None else fs.agent_dir, r + AGENT_DIR,
                linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC)
    if fs.egress_socket:
        # The socket file alone (never its host directory), read-only, where only root may reach it:
        # sandboxed code goes through the agent's relay, and the proxy checks its credential anyway.
        if not os.path.isdir(r + EGRESS_DIR):
            _mkdirs(r + EGRESS_DIR)
            os.chmod(r + EGRESS_DIR, 0o700)
            _touch(r + EGRESS_SOCKET)
        _attach(held.egress_socket if held.egress_socket is not None else fs.egress_socket, r + EGRESS_SOCKET,
                RO | linux.MS_NOEXEC)
    held.close()


def _pivot(r: str) -> None:
    """Swap roots: pivot_root(".", ".") stacks the old root under the new one; detaching it leaves
    no path back to the host tree."""
    os.chdir(r)
    linux.pivot_root(".", ".")
    linux.umount2(".", linux.MNT_DETACH)
    os.chdir("/")
