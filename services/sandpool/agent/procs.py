"""Finding, reaping and killing every process sandboxed code started.

The agent makes itself a child subreaper (`PR_SET_CHILD_SUBREAPER`), so a
process that double-forks or calls `setsid` to escape its worker is re-parented
to the agent instead of init: the agent's process tree is therefore the complete
set of sandboxed processes, and killing a subtree leaves nothing behind. The
agent also reaps every child itself (`waitpid(-1)`), so exit statuses are kept
here and nothing else in the process may wait for children.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterable

PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36


_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    """The C library, loaded once in the agent: a child between fork and exec must not dlopen."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def prctl(option: int, arg: int) -> bool:
    return libc().prctl(option, arg, 0, 0, 0) == 0


def become_subreaper() -> bool:
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def make_undumpable() -> bool:
    """Same-uid processes can no longer read this process's memory or environment."""
    return prctl(PR_SET_DUMPABLE, 0)


def proc_matches_this_namespace() -> bool:
    """Whether /proc numbers processes as this process sees them.

    In a PID namespace without its own /proc mount the numbers would be the
    host's, and a tree walk would name the wrong processes; then only process
    groups are signalled.
    """
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _parents() -> dict[int, int]:
    """pid -> ppid for every visible process (nothing when /proc is another namespace's)."""
    out: dict[int, int] = {}
    if not proc_matches_this_namespace():
        return out
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name is in parentheses and may itself contain spaces or parentheses.
        rest = stat[stat.rfind(b")") + 2:].split()
        if len(rest) > 1:
            out[int(name)] = int(rest[1])
    return out


def descendants(roots: Iterable[int], parents: dict[int, int] | None = None) -> set[int]:
    """Every process below `roots` (not the roots themselves)."""
    parents = _parents() if parents is None else parents
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def orphans(keep: set[int]) -> set[int]:
    """Processes re-parented to this (subreaper) agent that are not its live workers, and their trees."""
    parents = _parents()
    me = os.getpid()
    adopted = {pid for pid, ppid in parents.items() if ppid == me and pid not in keep}
    # uvicorn runs in-process, so any other child of the agent came from sandboxed code.
    return adopted | descendants(adopted, parents)


def signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_trees(roots: set[int], *, keep: set[int], include_roots: bool, rounds: int = 20) -> None:
    """SIGKILL everything below `roots` (and the roots when asked) plus the agent's orphans.

    Stops each round's set first, so a fork loop cannot outrun the kill, and
    repeats until nothing is left (bounded).
    """
    for _ in range(rounds):
        parents = _parents()
        targets = descendants(roots, parents)
        if include_roots:
            targets |= {pid for pid in roots if pid in parents}
        me = os.getpid()
        adopted = {pid for pid, ppid in parents.items() if ppid == me and pid not in keep and pid not in roots}
        targets |= adopted | descendants(adopted, parents)
        targets -= keep
        targets.discard(me)
        targets = {pid for pid in targets if not _is_zombie(pid)}
        if not targets:
            return
        signal_all(targets, signal.SIGSTOP)
        signal_all(targets, signal.SIGKILL)
        time.sleep(0.002)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return True
    rest = stat[stat.rfind(b")") + 2:].split()
    return bool(rest) and rest[0] in (b"Z", b"X")


class ChildReaper:
    """Reaps every child process of the agent (no zombie holds a pid or a slot of the process cap) and
    remembers the exit status of the ones asked about. Not the controller's `SessionReaper`."""

    def __init__(self) -> None:
        self.statuses: dict[int, int] = {}
        self.watched: set[int] = set()

    def watch(self, pid: int) -> None:
        self.watched.add(pid)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.watched:
                self.watched.discard(pid)
                self.statuses[pid] = status

    def record(self, pid: int, status: int) -> None:
        """The wait status of a watched process another process reaped (a runner the zygote's
        template forked into this sandbox is the template's child, not the agent's)."""
        if pid in self.watched:
            self.watched.discard(pid)
            self.statuses[pid] = status

    def forget(self, pid: int) -> None:
        """Stop watching `pid`, whose status will not come (so no later process with it is kept)."""
        self.watched.discard(pid)

    def exit_code(self, pid: int) -> int | None:
        """The shell-style code (128+N for a signal) once the process was reaped, else None."""
        self.reap()
        status = self.statuses.pop(pid, None)
        if status is None:
            return None
        code = os.waitstatus_to_exitcode(status)
        return 128 - code if code < 0 else code
