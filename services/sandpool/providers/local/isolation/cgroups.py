"""Per-sandbox memory, CPU and process-count limits through cgroups (v2, or v1 hierarchies).

Where the groups go: under the cgroup the service itself runs in (read from
/proc/self/cgroup), in one directory per zygote (`sandpool-z<pid>`) holding one
group per sandbox. Nesting under our own group keeps the sandboxes inside
whatever limits the operator (systemd, a container runtime) put on the service,
and never touches anybody else's groups. A zygote that died without cleaning up
leaves empty directories; the next one removes those of dead zygotes.

One sandbox, nested so that a fork bomb in sandboxed code can never starve the
agent (the process cap is on the code's own group, not on the agent's):

    <id>/                     memory, CPU quota, and the sandbox's total tasks (cap + AGENT_TASKS)
      sandbox/                the sandbox's cgroup-namespace root: all the agent can ever see or write
        agent/                (v2 only: v2 groups with children hold no processes; on v1 the agent
                              sits in sandbox/ itself)
        code/                 pids.max = the process cap; the agent starts every interpreter and
                              shell into a generation below it (`sandpool.agent.process_cap`)

cgroup v1 (this project's CI host): `memory` (`memory.limit_in_bytes` +
`memory.memsw.limit_in_bytes` where swap accounting exists, so swap is no way
around the limit) and `cpu` (`cpu.cfs_quota_us`) hold one group per sandbox;
the `pids` hierarchy holds the nesting above. cgroup v2: the same tree in the
unified hierarchy, with `memory.max`, `memory.swap.max`, `cpu.max` and
`pids.max`; it needs the service's group to delegate the controllers
(`cgroup.subtree_control`), which the root group and a systemd unit with
`Delegate=yes` do. The CPU controller is optional: without it sandboxes get no
CPU quota and the layer's detail says so.

The agent gets a descriptor of `code/` on a detached bind mount of that
directory alone (`open_tree`): `..` from it stops at `code/`, so a compromised
agent can neither lift the limits on `<id>/` nor reach another sandbox's
groups or the host's.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import linux

CONTROLLERS = ("memory", "pids")
OPTIONAL_CONTROLLERS = ("cpu",)
CPU_PERIOD_US = 100_000
V1_SHARES = (1024, 2, 262144)  # cpu.shares: one process's weight, the kernel's bounds
V2_WEIGHT = (100, 1, 10000)  # cpu.weight
NS_ROOT = "sandbox"
AGENT_DIR = "agent"
CODE_DIR = "code"
_ZYGOTE_DIR = re.compile(r"^sandpool-z(\d+)$")
# A v1 hierarchy's super options that name what it is (its controllers, or name=...), as a
# mount inside a sandbox's cgroup namespace must repeat them; nothing else (no release_agent).
_V1_SAFE_OPTION = re.compile(r"^(name=[\w.-]+|[a-z_]+)$")
_V1_NOT_CONTROLLERS = {"rw", "ro", "noprefix", "clone_children", "cpuset_v2_mode", "favordynmods", "xattr"}

log = logging.getLogger("sandpool.isolation")


class CgroupError(Exception):
    """The cgroup layer cannot be used; the message says why (for the isolation report)."""


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, super options) of every cgroup mount, from mountinfo."""
    found: list[tuple[str, str, str]] = []
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return found
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or len(rparts) < 3:
            continue
        if rparts[0] in ("cgroup", "cgroup2"):
            found.append((parts[4].replace("\\040", " "), rparts[0], rparts[2]))
    return found


def _own_paths() -> dict[str, str]:
    """Controller name ('' for the unified hierarchy) -> our group's path in it."""
    out: dict[str, str] = {}
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def _v1_mount_data(options: str) -> str:
    """The options that select one v1 hierarchy (e.g. `pids`, `cpu,cpuacct`)."""
    return ",".join(o for o in options.split(",")
                    if o not in _V1_NOT_CONTROLLERS and _V1_SAFE_OPTION.match(o))


@dataclass
class SandboxCgroup:
    """The groups of one sandbox.

    `dirs` are the top groups (`<id>`, one per hierarchy); `join_dirs` where the
    sandbox's first process goes; `code_dir` the process-capped group of sandboxed code.
    """

    dirs: list[Path]
    version: int = 2
    join_dirs: list[Path] = field(default_factory=list)
    code_dir: Path | None = None
    code_pids_max: int | None = None
    mount_data: str = ""  # v1: the options that mount the pids hierarchy
    on_removed: Callable[[], None] | None = field(default=None, repr=False)

    def join(self, pid: int = 0) -> None:
        """Move `pid` (0: the caller) into the sandbox's groups; done first thing in the sandbox.

        v1 writes the calling thread to `tasks`: a single-threaded process moves whole, and the
        kernel skips the global lock (and the RCU grace period, ~15 ms) a `cgroup.procs` write waits for.
        """
        for d in self.join_dirs or self.dirs:
            name = "tasks" if self.version == 1 and pid == 0 else "cgroup.procs"
            (d / name).write_text(str(pid))

    def agent_procs_files(self) -> list[Path]:
        """The `cgroup.procs` files of the groups the agent ends up in (after `settle`)."""
        if self.version == 2 and self.code_dir is not None:
            return [self.code_dir.parent / AGENT_DIR / "cgroup.procs"]
        return [d / "cgroup.procs" for d in self.join_dirs or self.dirs]

    def settle(self) -> None:
        """In the sandbox, after it unshared its cgroup namespace (rooted at `sandbox/`): on v2,
        leave `sandbox/` for `sandbox/agent/` and turn on the pids controller below it, which v2
        allows only for a group without processes, so `code/` gets its cap."""
        if self.version != 2 or self.code_dir is None:
            return
        ns_root = self.code_dir.parent
        (ns_root / AGENT_DIR / "cgroup.procs").write_text("0")
        (ns_root / "cgroup.subtree_control").write_text("+pids")
        if self.code_pids_max:
            (self.code_dir / "pids.max").write_text(str(self.code_pids_max))
        (self.code_dir / "cgroup.subtree_control").write_text("+pids")

    def open_code_dir(self, *, private_mount_at: str | None) -> int:
        """A descriptor of `code/` for the agent (close-on-exec) that `..` cannot leave.

        It lives on a detached bind mount of `code/` alone (`open_tree`), so walking up from
        it ends at `code/` itself. Where `open_tree` is missing (Linux < 5.2) and
        `private_mount_at` is given (an empty directory, in the sandbox's own mount and cgroup
        namespaces), it comes from a cgroup mount rooted at the namespace's root (`sandbox/`),
        detached right away. Without either it is the host path, and the agent could walk up.
        """
        assert self.code_dir is not None
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            tree = linux.open_tree_clone(str(self.code_dir))
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EINVAL):
                raise
        else:
            try:
                return os.open(".", flags, dir_fd=tree)  # a readable descriptor on the same mount
            finally:
                os.close(tree)
        if private_mount_at is None:
            return os.open(self.code_dir, flags)
        linux.mount(None, "/", None, linux.MS_REC | linux.MS_PRIVATE)
        fstype, data = ("cgroup2", None) if self.version == 2 else ("cgroup", self.mount_data)
        linux.mount("sandpool-cgroup", private_mount_at, fstype,
                    linux.MS_NOSUID | linux.MS_NODEV | linux.MS_NOEXEC, data)
        try:
            return os.open(os.path.join(private_mount_at, CODE_DIR), flags)
        finally:
            linux.umount2(private_mount_at, linux.MNT_DETACH)

    def _tree(self) -> list[Path]:
        """Every group of the sandbox, deepest first (the agent makes groups below code/)."""
        out: list[Path] = []
        for top in self.dirs:
            stack, seen = [top], []
            while stack:
                d = stack.pop()
                seen.append(d)
                stack.extend(_children(d))
            out.extend(reversed(seen))
        return out

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self._tree():
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return found

    def memory_events(self) -> dict[str, int]:
        """How often the limits fired: {'oom_kill': n, 'pids_max': n} where readable."""
        out: dict[str, int] = {}
        for d in self._tree():  # a fork fails in (v1), or at the limit of (v2), a nested group
            for name, key, out_key in (("memory.events", "oom_kill", "oom_kill"),
                                       ("memory.oom_control", "oom_kill", "oom_kill"),
                                       ("pids.events", "max", "pids_max")):
                if d not in self.dirs and name != "pids.events":
                    continue
                try:
                    for line in (d / name).read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == key:
                            out[out_key] = out.get(out_key, 0) + int(v)
                except (OSError, ValueError):
                    pass
        return out

    def remove(self, deadline_seconds: float = 2.0) -> bool:
        """Kill whatever is left in the groups and remove them, deepest first. True when all are gone."""
        deadline = time.monotonic() + deadline_seconds
        for top in self.dirs:
            kill = top / "cgroup.kill"  # v2: the whole subtree at once
            if self.version == 2 and kill.exists():
                try:
                    kill.write_text("1")
                except OSError:
                    pass
        while True:
            remaining = []
            for d in self._tree():
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                        continue
                    remaining.append(d)
                    try:
                        members = [int(p) for p in (d / "cgroup.procs").read_text().split()]
                    except (OSError, ValueError):
                        members = []
                    for pid in members:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
            if not remaining or time.monotonic() > deadline:
                if not remaining and self.on_removed is not None:
                    self.on_removed()
                    self.on_removed = None
                return not remaining
            time.sleep(0.005)


@dataclass
class CgroupManager:
    """Creates and removes the per-sandbox groups of one zygote."""

    version: int
    bases: dict[str, Path] = field(default_factory=dict)  # controller -> this zygote's base dir
    cpu: bool = False
    mount_data: dict[str, str] = field(default_factory=dict)  # v1 controller -> its mount options
    cpu_missing: str = ""
    cpu_weights: dict[str, int] = field(default_factory=dict)  # sandbox -> its CPU weight

    @property
    def detail(self) -> str:
        controllers = "memory,pids,cpu" if self.cpu else "memory,pids"
        detail = f"v{self.version} {controllers}"
        if not self.cpu:
            detail += f" (no CPU quota: {self.cpu_missing or 'no cpu controller'})"
        return detail

    def create(self, name: str, *, memory_bytes: int | None, pids_max: int | None,
               code_pids_max: int | None = None, cpu_millis: int | None = None) -> SandboxCgroup:
        """The sandbox's groups. `pids_max` caps every task of the sandbox, the agent's included;
        `code_pids_max` caps sandboxed code alone; `cpu_millis` is the CPU quota in thousandths
        of a core (needs the cpu controller; ignored without it)."""
        dirs: list[Path] = []
        try:
            if self.version == 2:
                top = self.bases[""] / name
                top.mkdir()
                dirs.append(top)
                if memory_bytes:
                    (top / "memory.max").write_text(str(memory_bytes))
                    _write_optional(top / "memory.swap.max", "0")
                if self.cpu:
                    if cpu_millis:
                        (top / "cpu.max").write_text(f"{_quota_us(cpu_millis)} {CPU_PERIOD_US}")
                    self._weigh(name, top / "cpu.weight", cpu_millis, V2_WEIGHT)
                if pids_max:
                    (top / "pids.max").write_text(str(pids_max))
                (top / "cgroup.subtree_control").write_text("+pids")
                ns_root = top / NS_ROOT
                ns_root.mkdir()
                (ns_root / AGENT_DIR).mkdir()
                (ns_root / CODE_DIR).mkdir()
                return SandboxCgroup(dirs, 2, [ns_root], ns_root / CODE_DIR, code_pids_max,
                                     on_removed=lambda: self._unweigh(name))
            mem = self.bases["memory"] / name
            mem.mkdir()
            dirs.append(mem)
            if memory_bytes:
                (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
                _write_optional(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
            join = [mem]
            if self.cpu:
                cpu = self.bases["cpu"] / name
                cpu.mkdir()
                dirs.append(cpu)
                if cpu_millis:
                    (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                    (cpu / "cpu.cfs_quota_us").write_text(str(_quota_us(cpu_millis)))
                self._weigh(name, cpu / "cpu.shares", cpu_millis, V1_SHARES)
                join.append(cpu)
            pids = self.bases["pids"] / name
            pids.mkdir()
            dirs.append(pids)
            if pids_max:
                (pids / "pids.max").write_text(str(pids_max))
            ns_root = pids / NS_ROOT
            ns_root.mkdir()
            code = ns_root / CODE_DIR
            code.mkdir()
            if code_pids_max:
                (code / "pids.max").write_text(str(code_pids_max))
            join.append(ns_root)
            return SandboxCgroup(dirs, 1, join, code, code_pids_max, self.mount_data.get("pids", "pids"),
                                 on_removed=lambda: self._unweigh(name))
        except OSError as exc:
            SandboxCgroup(dirs, self.version, on_removed=lambda: self._unweigh(name)).remove(0.5)
            raise CgroupError(f"cannot create the sandbox's cgroup: {exc.strerror}") from None

    def _weigh(self, name: str, path: Path, cpu_millis: int | None, scale: tuple[int, int, int]) -> None:
        """Give the sandbox's group the CPU weight of its quota (one busy process per core it may
        use; one without a quota weighs one), and the zygote's base group the sum of them all.

        Without the second step every sandbox of the zygote would share the weight of a
        single process against whatever else runs beside the service: a busy host would
        starve them all, and a busy control plane would too."""
        default, low, high = scale
        weight = min(high, max(low, default * (cpu_millis or 1000) // 1000))
        path.write_text(str(weight))
        self.cpu_weights[name] = weight
        self._write_base_weight(scale)

    def _unweigh(self, name: str) -> None:
        if self.cpu_weights.pop(name, None) is not None:
            self._write_base_weight(V2_WEIGHT if self.version == 2 else V1_SHARES)

    def _write_base_weight(self, scale: tuple[int, int, int]) -> None:
        default, low, high = scale
        base = self.bases["" if self.version == 2 else "cpu"]
        total = min(high, max(default, sum(self.cpu_weights.values())))
        _write_optional(base / ("cpu.weight" if self.version == 2 else "cpu.shares"), str(total))

    def close(self) -> None:
        """Remove this zygote's base directories (every sandbox group must be gone)."""
        for base in self.bases.values():
            for child in _children(base):
                SandboxCgroup([child], self.version).remove(1.0)
            try:
                base.rmdir()
            except OSError:
                pass


def _quota_us(cpu_millis: int) -> int:
    return max(1000, cpu_millis * CPU_PERIOD_US // 1000)  # the kernel's smallest quota is 1 ms


def _write_optional(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass


def _children(base: Path) -> list[Path]:
    """Sub-groups of `base` (from the directory's own entry types: no stat per control file)."""
    try:
        with os.scandir(base) as entries:
            return [base / e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _sweep_dead_zygotes(parent: Path) -> None:
    for entry in _children(parent):
        m = _ZYGOTE_DIR.match(entry.name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # that zygote still runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        CgroupManager(1, {"x": entry}).close()


def setup(owner_pid: int, *, prefer: str = "auto") -> CgroupManager:
    """Find usable memory+pids (and, if there, cpu) hierarchies and create this zygote's base groups.

    Raises CgroupError naming what is missing. `prefer` is `auto`, `v1` or `v2`.
    """
    mounts = _mounts()
    own = _own_paths()
    v1: dict[str, Path] = {}
    v1_options: dict[str, str] = {}
    v2_root: Path | None = None
    for mountpoint, fstype, options in mounts:
        if fstype == "cgroup2":
            v2_root = Path(mountpoint)
        else:
            for ctl in CONTROLLERS + OPTIONAL_CONTROLLERS:
                if ctl in options.split(","):
                    v1[ctl] = Path(mountpoint)
                    v1_options[ctl] = _v1_mount_data(options)
    name = f"sandpool-z{owner_pid}"
    reasons = []

    if prefer in ("auto", "v2") and v2_root is not None and "" in own:
        parent = v2_root / own[""].lstrip("/")
        try:
            available = (parent / "cgroup.controllers").read_text().split()
        except OSError:
            available = []
        if all(c in available for c in CONTROLLERS):
            wanted = [c for c in CONTROLLERS + OPTIONAL_CONTROLLERS if c in available]
            try:
                enabled = (parent / "cgroup.subtree_control").read_text().split()
                missing = [c for c in wanted if c not in enabled]
                if missing:
                    try:
                        (parent / "cgroup.subtree_control").write_text(" ".join("+" + c for c in missing))
                    except OSError:
                        if any(c in missing for c in CONTROLLERS):
                            raise
                        wanted = [c for c in wanted if c in enabled or c in CONTROLLERS]
                base = parent / name
                _sweep_dead_zygotes(parent)
                base.mkdir(exist_ok=True)
                (base / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
                cpu = "cpu" in wanted
                return CgroupManager(2, {"": base}, cpu=cpu,
                                     cpu_missing="" if cpu else f"group {own['']} does not delegate cpu")
            except OSError as exc:
                reasons.append(f"v2 group {own['']} does not delegate memory,pids ({exc.strerror})")
        else:
            reasons.append("v2 hierarchy lacks the memory/pids controllers")

    if prefer in ("auto", "v1"):
        if all(c in v1 for c in CONTROLLERS):
            bases: dict[str, Path] = {}
            cpu_missing = "" if "cpu" in v1 else "no v1 cpu hierarchy mounted"
            try:
                for ctl in CONTROLLERS + OPTIONAL_CONTROLLERS:
                    if ctl not in v1:
                        continue
                    parent = v1[ctl] / own.get(ctl, "/").lstrip("/")
                    _sweep_dead_zygotes(parent)
                    base = parent / name
                    try:
                        base.mkdir(exist_ok=True)
                    except OSError as exc:
                        if ctl in CONTROLLERS:
                            raise
                        cpu_missing = f"v1 cpu hierarchy not writable ({exc.strerror})"
                        continue
                    bases[ctl] = base
                return CgroupManager(1, bases, cpu="cpu" in bases, mount_data=v1_options, cpu_missing=cpu_missing)
            except OSError as exc:
                CgroupManager(1, bases).close()
                reasons.append(f"v1 memory/pids hierarchies not writable ({exc.strerror})")
        else:
            reasons.append("no v1 memory+pids hierarchies mounted")
    raise CgroupError("; ".join(reasons) or "no cgroup hierarchy")
