"""Per-sandbox memory and process-count limits through cgroups (v2, or v1 hierarchies).

Where the groups go: under the cgroup the service itself runs in (read from
/proc/self/cgroup), in one directory per zygote (`sandpool-z<pid>`) holding one
group per sandbox. Nesting under our own group keeps the sandboxes inside
whatever limits the operator (systemd, a container runtime) put on the service,
and never touches anybody else's groups. A zygote that died without cleaning up
leaves empty directories; the next one removes those of dead zygotes.

cgroup v1 (this project's CI host): the `memory` and `pids` hierarchies, with
`memory.limit_in_bytes` (+ `memory.memsw.limit_in_bytes` where swap accounting
exists, so swap is no way around the limit) and `pids.max`.
cgroup v2: one directory in the unified hierarchy with `memory.max`,
`memory.swap.max` and `pids.max`; it needs the service's group to delegate the
two controllers (`cgroup.subtree_control`), which the root group and a systemd
unit with `Delegate=yes` do.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

CONTROLLERS = ("memory", "pids")
_ZYGOTE_DIR = re.compile(r"^sandpool-z(\d+)$")


class CgroupError(Exception):
    """The cgroup layer cannot be used; the message says why (for the isolation report)."""


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fstype, super options) of every cgroup mount, from mountinfo."""
    found = []
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


@dataclass
class SandboxCgroup:
    """The groups of one sandbox: one directory per hierarchy (one on v2, two on v1)."""

    dirs: list[Path]

    def join(self, pid: int = 0) -> None:
        """Move `pid` (0: the caller) into every group; done first thing in the sandbox."""
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return found

    def memory_events(self) -> dict[str, int]:
        """How often the limits fired: {'oom_kill': n, 'pids_max': n} where readable."""
        out: dict[str, int] = {}
        for d in self.dirs:
            for name, key, out_key in (("memory.events", "oom_kill", "oom_kill"),
                                       ("memory.oom_control", "oom_kill", "oom_kill"),
                                       ("pids.events", "max", "pids_max")):
                try:
                    for line in (d / name).read_text().splitlines():
                        k, _, v = line.partition(" ")
                        if k == key:
                            out[out_key] = out.get(out_key, 0) + int(v)
                except (OSError, ValueError):
                    pass
        return out

    def remove(self, deadline_seconds: float = 2.0) -> bool:
        """Kill whatever is left in the groups and remove them. True when all are gone."""
        deadline = time.monotonic() + deadline_seconds
        remaining = list(self.dirs)
        while remaining:
            for d in list(remaining):
                try:
                    d.rmdir()
                    remaining.remove(d)
                except FileNotFoundError:
                    remaining.remove(d)
                except OSError as exc:
                    if exc.errno != errno.EBUSY:
                        remaining.remove(d)
                        continue
                    kill = d / "cgroup.kill"
                    if kill.exists():
                        try:
                            kill.write_text("1")
                        except OSError:
                            pass
                    for pid in SandboxCgroup([d]).pids():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except OSError:
                            pass
            if not remaining or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return not remaining


@dataclass
class CgroupManager:
    """Creates and removes the per-sandbox groups of one zygote."""

    version: int
    bases: dict[str, Path] = field(default_factory=dict)  # controller -> this zygote's base dir

    @property
    def detail(self) -> str:
        return f"v{self.version} memory,pids"

    def create(self, name: str, *, memory_bytes: int | None, pids_max: int | None) -> SandboxCgroup:
        dirs: list[Path] = []
        try:
            if self.version == 2:
                d = self.bases[""] / name
                d.mkdir()
                dirs.append(d)
                if memory_bytes:
                    (d / "memory.max").write_text(str(memory_bytes))
                    _write_optional(d / "memory.swap.max", "0")
                if pids_max:
                    (d / "pids.max").write_text(str(pids_max))
            else:
                mem = self.bases["memory"] / name
                mem.mkdir()
                dirs.append(mem)
                if memory_bytes:
                    (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
                    _write_optional(mem / "memory.memsw.limit_in_bytes", str(memory_bytes))
                pids = self.bases["pids"] / name
                pids.mkdir()
                dirs.append(pids)
                if pids_max:
                    (pids / "pids.max").write_text(str(pids_max))
        except OSError as exc:
            SandboxCgroup(dirs).remove(0.5)
            raise CgroupError(f"cannot create the sandbox's cgroup: {exc.strerror}") from None
        return SandboxCgroup(dirs)

    def close(self) -> None:
        """Remove this zygote's base directories (every sandbox group must be gone)."""
        for base in self.bases.values():
            for child in _children(base):
                SandboxCgroup([child]).remove(1.0)
            try:
                base.rmdir()
            except OSError:
                pass


def _write_optional(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass


def _children(base: Path) -> list[Path]:
    try:
        return [p for p in base.iterdir() if p.is_dir()]
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
    """Find usable memory+pids hierarchies and create this zygote's base groups.

    Raises CgroupError naming what is missing. `prefer` is `auto`, `v1` or `v2`.
    """
    mounts = _mounts()
    own = _own_paths()
    v1: dict[str, Path] = {}
    v2_root: Path | None = None
    for mountpoint, fstype, options in mounts:
        if fstype == "cgroup2":
            v2_root = Path(mountpoint)
        else:
            for ctl in CONTROLLERS:
                if ctl in options.split(","):
                    v1[ctl] = Path(mountpoint)
    name = f"sandpool-z{owner_pid}"
    reasons = []

    if prefer in ("auto", "v2") and v2_root is not None and "" in own:
        parent = v2_root / own[""].lstrip("/")
        try:
            available = (parent / "cgroup.controllers").read_text().split()
        except OSError:
            available = []
        if all(c in available for c in CONTROLLERS):
            try:
                enabled = (parent / "cgroup.subtree_control").read_text().split()
                missing = [c for c in CONTROLLERS if c not in enabled]
                if missing:
                    (parent / "cgroup.subtree_control").write_text(" ".join("+" + c for c in missing))
                base = parent / name
                _sweep_dead_zygotes(parent)
                base.mkdir(exist_ok=True)
                (base / "cgroup.subtree_control").write_text("+memory +pids")
                return CgroupManager(2, {"": base})
            except OSError as exc:
                reasons.append(f"v2 group {own['']} does not delegate memory,pids ({exc.strerror})")
        else:
            reasons.append("v2 hierarchy lacks the memory/pids controllers")

    if prefer in ("auto", "v1"):
        if all(c in v1 for c in CONTROLLERS):
            bases: dict[str, Path] = {}
            try:
                for ctl in CONTROLLERS:
                    parent = v1[ctl] / own.get(ctl, "/").lstrip("/")
                    _sweep_dead_zygotes(parent)
                    base = parent / name
                    base.mkdir(exist_ok=True)
                    bases[ctl] = base
                return CgroupManager(1, bases)
            except OSError as exc:
                CgroupManager(1, bases).close()
                reasons.append(f"v1 memory/pids hierarchies not writable ({exc.strerror})")
        else:
            reasons.append("no v1 memory+pids hierarchies mounted")
    raise CgroupError("; ".join(reasons) or "no cgroup hierarchy")
