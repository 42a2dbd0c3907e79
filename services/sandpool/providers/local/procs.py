"""Finding and killing a sandbox's processes on this host, from `/proc`.

A pid alone is not an identity (pids are reused), so a sandbox's agent is
recorded as (pid, start time in clock ticks since boot). A process tree is
killed three ways, because hostile code tries to escape each one: the agent's
process group, every descendant found by parent links, and, when the sandbox
has a uid of its own, every process of that uid (which catches code that
called setsid() and double-forked away from the tree).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
EXIT_WAIT_SECONDS = 2.0
"""How long `kill_tree` waits for a SIGKILLed agent to be gone (a zombie counts as gone)."""


@dataclass(frozen=True)
class ProcessHandle:
    """A launched agent: its pid, its process group and its start time (for pid reuse)."""

    pid: int
    pgid: int
    start_time: int | None = None

    def to_line(self) -> str:
        return f"{self.pid} {self.pgid} {self.start_time or 0}\n"

    @classmethod
    def from_line(cls, text: str) -> ProcessHandle | None:
        parts = text.split()
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            return None
        pid, pgid, start = (int(p) for p in parts)
        return cls(pid=pid, pgid=pgid, start_time=start or None)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after its last ')'.
    rest = raw[raw.rfind(")") + 2:].split()
    return rest  # rest[0] is field 3 (state)


def start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None  # field 22


def is_alive(handle: ProcessHandle) -> bool:
    fields = _stat_fields(handle.pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return handle.start_time is None or int(fields[19]) == handle.start_time


def _all_pids() -> list[int]:
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for child in _all_pids():
        fields = _stat_fields(child)
        if fields:
            children.setdefault(int(fields[1]), []).append(child)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def pids_of_uid(uid: int) -> set[int]:
    found = set()
    for pid in _all_pids():
        try:
            status = (PROC / str(pid) / "status").read_text()
        except OSError:
            continue
        state = ""
        for line in status.splitlines():
            if line.startswith("State:"):
                state = line.split()[1]
            elif line.startswith("Uid:"):
                # Zombies hold no resources and only their parent can clear them.
                if state not in ("Z", "X") and uid in (int(x) for x in line.split()[1:]):
                    found.add(pid)
                break
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def kill_tree(handle: ProcessHandle, *, grace: float) -> None:
    """SIGTERM the agent's group, wait up to `grace`, then SIGKILL group and descendants, and wait
    (bounded) until the agent is gone: a caller told the sandbox is destroyed may rely on it.
    Exiting takes the kernel a moment (a killed agent's memory is torn down first).

    A zombie counts as gone, and is never reaped here: an agent that is our child was started by
    the event loop's subprocess machinery, which reaps it. A `waitpid` of ours could take its exit
    first, and then uvloop never learns it: the process handle stays open, and closing the loop
    waits for it for ever."""
    loop = asyncio.get_running_loop()
    if is_alive(handle):
        tree = descendants(handle.pid)
        _signal_group(handle.pgid, signal.SIGTERM)
        deadline = loop.time() + grace
        while is_alive(handle) and loop.time() < deadline:  # noqa: ASYNC110 - /proc is all that says it is gone
            await asyncio.sleep(0.02)
        tree |= descendants(handle.pid) if is_alive(handle) else set()
        _signal_group(handle.pgid, signal.SIGKILL)
        if is_alive(handle):
            _signal(handle.pid, signal.SIGKILL)
        for pid in tree:
            _signal(pid, signal.SIGKILL)
    else:
        # The agent is gone; its group may live on.
        _signal_group(handle.pgid, signal.SIGKILL)
    deadline = loop.time() + EXIT_WAIT_SECONDS
    while is_alive(handle) and loop.time() < deadline:  # noqa: ASYNC110 - as above
        await asyncio.sleep(0.005)


async def kill_uid(uid: int, gid: int, *, rounds: int = 20) -> bool:
    """Kill every process of a uid dedicated to one sandbox. True once none is left.

    `kill -9 -1` run *as that uid* signals exactly the processes the uid may
    signal (its own) in one kernel pass, so a fork loop cannot outrun a scan.
    Never call this for a uid shared with anything else (or with ourselves).
    """
    if uid == os.getuid() or uid == 0:
        raise ValueError("refusing to kill every process of a shared uid")
    for _ in range(rounds):
        if not await asyncio.to_thread(pids_of_uid, uid):  # a /proc scan: off the event loop
            return True
        # In a thread with the standard library's subprocess: uvloop's (the services' loop) has no
        # `user=`/`group=`, and a change of uid must happen in the child, never in this process.
        await asyncio.to_thread(_kill_everything_as, uid, gid)
        await asyncio.sleep(0.01)
    return not await asyncio.to_thread(pids_of_uid, uid)


def _kill_everything_as(uid: int, gid: int) -> None:
    subprocess.run(["kill", "-9", "-1"], user=uid, group=gid, extra_groups=[], stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, check=False)
