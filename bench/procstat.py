"""CPU from the kernel's own accounting: /proc for processes and the machine, cpuacct groups for trees.

A process's /proc/<pid>/stat stops counting when it exits, and its children's time reaches
its parent only if the parent waits for them; a cpuacct group keeps charging every process
ever started in it, so a process tree whose members come and go (sandboxes, per-session
runners) is measured by the group it runs in.
"""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rfind(")") + 2:].split()


def process_seconds(pid: int) -> float:
    """user+system of the process itself (its threads), not of its children."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def system_seconds(pid: int) -> float:
    """The kernel's share of `process_seconds` (syscalls, mounts, page faults)."""
    return int(_stat(pid)[12]) / CLK_TCK


def children_of(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int(_stat(int(entry.name))[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def descendants_of(pid: int) -> list[int]:
    """Every live process below `pid`, parents before their children."""
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in children_of(parent)]
        found += children
        frontier = children
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def machine_seconds() -> float:
    """Busy CPU of the whole machine: every /proc/stat cpu column but idle and iowait."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


class CpuGroup:
    """A cgroup v1 `cpuacct` group of our own: it charges every process moved into it, and all they
    fork, for good; a group's usage includes its nested groups'. Moving a process charges only what
    it spends from then on: measure differences. (cgroup v2 moves a sandbox into groups of its own,
    out of any group we made, so there the sandboxes are read from the zygote's group instead.)"""

    def __init__(self, name: str, parent: CpuGroup | None = None) -> None:
        if not CPUACCT.is_dir():
            raise SystemExit("cpu_budget: no cgroup v1 cpuacct hierarchy to account a process tree with")
        self.path: Path = (parent.path if parent else CPUACCT) / name
        self.path.mkdir(exist_ok=True)

    @staticmethod
    def available() -> bool:
        return CPUACCT.is_dir()

    def add(self, *pids: int) -> None:
        for pid in pids:
            (self.path / "cgroup.procs").write_text(str(pid))

    def seconds(self) -> float:
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def release(self) -> None:
        """Hand what is left in it (nested groups first) back to the root group, and remove it."""
        for group in sorted((d for d in self.path.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
            _empty(group)
        _empty(self.path)


def _empty(group: Path) -> None:
    try:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (CPUACCT / "cgroup.procs").write_text(pid)
            except OSError:
                continue  # gone meanwhile
        group.rmdir()
    except OSError:
        pass
