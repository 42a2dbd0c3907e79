"""The process cap of sandboxed code, kept by the agent in the code's own cgroup.

The local provider's zygote hands the agent a descriptor of `code/`, a cgroup
whose `pids.max` is the sandbox's process cap (`providers/local/isolation/cgroups.py`).
The agent itself lives outside it, so a fork bomb can fill the cap but never
stop the agent from forking a fresh interpreter or shell. Every child the agent
starts puts itself, before it runs anything of the caller's, into the **live generation**
`code/g<N>`: the group of the calls now running.

What a call leaves running (`server &`) stays behind in its generation when the
call ends: the agent moves its own children (interpreter, spare, shell) to a
new live generation. A generation therefore holds exactly what one call
started, and everything that descends from it. Each generation is capped at
the cap less a reserve (an eighth; `MIN_RESERVE` for small caps), so what one call
left running, however fast it forks, cannot take the last processes from the
calls that come after it.

The cap is hit when a fork fails in a group (`pids.events`: on v1 it counts the
failed forks of the group's own processes; on v2, the times the group's own
limit stopped one, the code group's counting the whole subtree). Then:

- the live generation hit it during a call: every process of that generation
  but the agent's children is killed when the call ends (the result says so);
- a background generation hit it (during or between calls): the whole
  generation is killed, at the next call's start or end, or within a second.

Backgrounded processes of calls that stayed under the cap live on. Killing
stops each round's processes before it kills them, so a fork loop cannot
outrun it. The interpreter reaps the ones that were its own children (it is
asked to), so no zombie keeps holding a slot of the cap.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("sandpool.agent.process_cap")

RESERVE_FRACTION = 8
"""An eighth of the cap (at least MIN_RESERVE) no single generation may take."""
MIN_RESERVE = 8
REAP_SECONDS = 0.2
SETTLE_SECONDS = 0.1
SETTLE_POLL_SECONDS = 0.005
MAX_BACKGROUND_GENERATIONS = 32
"""Beyond this many generations still running, what calls leave behind stays in the live one."""
KILL_ROUNDS = 50
MAX_PENDING_REAP = 4096


@dataclass
class Generation:
    name: str
    dir_fd: int
    events_fd: int
    seen: int = 0
    """The group's `pids.events` max count when last looked at."""


@dataclass
class CallReport:
    hit: bool = False
    killed: set[int] | None = None


class CodeCgroup:
    """The code cgroup and its generations (see the module docstring). One per agent."""

    def __init__(self, dir_fd: int, *, version: int, cap: int | None,
                 reap: Callable[[], None] = lambda: None) -> None:
        self.dir_fd = dir_fd
        self._reap = reap
        self.version = version
        self.cap = cap
        self.reserve = max(min(MIN_RESERVE, (cap or 0) // 4), (cap or 0) // RESERVE_FRACTION)
        self._code_events = os.open("pids.events", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        self._code_seen = 0
        self._counter = 0
        self.live: Generation | None = None
        self.background: list[Generation] = []
        self.join_fd = -1
        """Written "0" by each new child before it runs a call: it moves into the live generation."""
        self.killed_children: set[int] = set()
        """Killed processes that may be zombies of the interpreter, for it to reap."""

    # -- set-up ------------------------------------------------------------------------------
    def start(self) -> None:
        """Make the first live generation (removing any an earlier agent in this sandbox left)."""
        for name in os.listdir(self.dir_fd):
            if name.startswith("g") and name[1:].isdigit():
                self._remove(name, kill=True)
        self.live = self._new_generation()
        self._code_seen = _max_events(self._code_events)

    def _new_generation(self) -> Generation:
        self._counter += 1
        name = f"g{self._counter}"
        os.mkdir(name, dir_fd=self.dir_fd)
        dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        events_fd = os.open("pids.events", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        # v1 `tasks` with "0" moves the (single-threaded, just forked) writer without the global
        # lock a `cgroup.procs` write takes; v2 has only `cgroup.procs`.
        if self.cap:
            _write(dir_fd, "pids.max", str(max(1, self.cap - self.reserve)))
        join = os.open("tasks" if self.version == 1 else "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC,
                       dir_fd=dir_fd)
        old, self.join_fd = self.join_fd, join
        if old >= 0:
            os.close(old)
        return Generation(name, dir_fd, events_fd, _max_events(events_fd))

    def adopt(self, pid: int) -> None:
        """Move a child the agent has just started into the live generation. For a runner that
        hardens itself (no `preexec_fn` to join): done before the agent awaits anything, so no
        generation change can come between its start and its join."""
        os.write(self.join_fd, str(pid).encode())

    # -- around each call --------------------------------------------------------------------
    def begin_call(self) -> None:
        """Kill background generations that hit the cap; forget the live one's earlier count."""
        self.check_background()
        if self.live is not None:
            self.live.seen = _max_events(self.live.events_fd)
        self._code_seen = _max_events(self._code_events)

    async def end_call(self, keep: set[int]) -> CallReport:
        """After a call: kill what it started if it hit the cap; otherwise, if it left processes
        running, leave them in their generation and start a new live one. `keep`: the agent's
        own children (interpreter, spare, shell).

        What a call leaves running is watched for a moment (`SETTLE_SECONDS`, only while it is
        still forking): a bomb that returned at once (`:(){ :|:& };:`) reaches the cap then, and
        counts as this call's, killed before the next call starts instead of writing its
        complaints into that call's output."""
        report = CallReport()
        live = self.live
        if live is None:
            return report
        background_hits = self.check_background()
        own_hits = _max_events(live.events_fd) - live.seen
        code_hits = _max_events(self._code_events) - self._code_seen
        # v2: the code group's count also moves when its own (shared) limit stopped a fork,
        # which no generation's count shows; outside what background generations account for,
        # that was the live call's.
        if own_hits > 0 or (self.version == 2 and code_hits > background_hits):
            report.hit = True
            report.killed = self._kill_members(live, keep)
            live.seen = _max_events(live.events_fd)
        self._code_seen = _max_events(self._code_events)
        if not report.hit and _members(live.dir_fd) - keep and self._leave_behind(live, keep):
            if await self._settles(live):
                return report
            report.hit = True
            live.seen = _max_events(live.events_fd)
            report.killed = self._kill_members(live, set())
            self._try_remove(live)
        return report

    async def _settles(self, gen: Generation) -> bool:
        """False if the group hits the cap while it is still growing, within SETTLE_SECONDS."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_SECONDS
        count = _tasks(gen.dir_fd)
        while True:
            if _max_events(gen.events_fd) > gen.seen:
                return False
            if loop.time() >= deadline:
                return True
            await asyncio.sleep(SETTLE_POLL_SECONDS)
            previous, count = count, _tasks(gen.dir_fd)
            if count <= previous and _max_events(gen.events_fd) == gen.seen:
                return True

    def check_background(self) -> int:
        """Kill every background generation whose fork hit the cap; remove the empty ones.
        Returns how many cap hits were found."""
        hits = 0
        for gen in list(self.background):
            count = _max_events(gen.events_fd)
            if count > gen.seen:
                hits += count - gen.seen
                gen.seen = count
                killed = self._kill_members(gen, set())
                log.warning("processes left running by an earlier call hit the process cap and were killed",
                            extra={"killed": len(killed)})
            self._try_remove(gen)
        return hits

    # -- mechanics ---------------------------------------------------------------------------
    def _leave_behind(self, old: Generation, keep: set[int]) -> bool:
        if len(self.background) >= MAX_BACKGROUND_GENERATIONS:
            return False
        new = self._new_generation()
        procs = os.open("cgroup.procs", os.O_WRONLY | os.O_CLOEXEC, dir_fd=new.dir_fd)
        try:
            for pid in sorted(keep & _members(old.dir_fd)):
                try:
                    os.write(procs, str(pid).encode())
                except ProcessLookupError:
                    pass
        finally:
            os.close(procs)
        self.background.append(old)
        self.live = new
        return True

    def _kill_members(self, gen: Generation, keep: set[int]) -> set[int]:
        """SIGSTOP then SIGKILL every process of the group but `keep`, round after round."""
        killed: set[int] = set()
        for _ in range(KILL_ROUNDS):
            targets = _members(gen.dir_fd) - keep - {os.getpid()}
            if not targets:
                break
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in targets:
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            killed |= targets
            time.sleep(0.001)
        if len(self.killed_children) < MAX_PENDING_REAP:
            self.killed_children |= killed
        self._reap_orphans(killed)
        return killed

    def _reap_orphans(self, killed: set[int]) -> None:
        """Reap, now, the killed processes that were the agent's (orphans re-parented to it):
        until then their zombies hold slots of the cap, and the next call's forks would fail.
        (Its event loop gets no SIGCHLD: uvloop keeps that signal to itself.)"""
        me = os.getpid()
        deadline = time.monotonic() + REAP_SECONDS
        while True:
            self._reap()
            left = [pid for pid in killed if _parent(pid) == me]
            if not left or time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def _try_remove(self, gen: Generation) -> None:
        try:
            os.rmdir(gen.name, dir_fd=self.dir_fd)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                return  # still has processes (or zombies not yet reaped)
        for fd in (gen.dir_fd, gen.events_fd):
            os.close(fd)
        self.background.remove(gen)

    def _remove(self, name: str, *, kill: bool) -> None:
        try:
            dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        except OSError:
            return
        try:
            if kill:
                self._kill_members(Generation(name, dir_fd, -1), set())
        finally:
            os.close(dir_fd)
        try:
            os.rmdir(name, dir_fd=self.dir_fd)
        except OSError:
            pass

    def take_killed_children(self) -> list[int]:
        killed, self.killed_children = self.killed_children, set()
        return sorted(killed)


def from_settings(settings: object, reap: Callable[[], None]) -> CodeCgroup | None:
    """The code cgroup the zygote handed over (`--code-cgroup-fd`), started; None without one.
    `reap`: reaps the agent's exited children."""
    fd = getattr(settings, "code_cgroup_fd", None)
    if fd is None:
        return None
    cap = CodeCgroup(fd, version=getattr(settings, "code_cgroup_version", 2),
                     cap=getattr(settings, "process_cap", None), reap=reap)
    cap.start()
    return cap


def _max_events(fd: int) -> int:
    """The `max` count of a `pids.events` file (re-read from the start each time)."""
    try:
        data = os.pread(fd, 256, 0)
    except OSError:
        return 0
    for line in data.split(b"\n"):
        key, _, value = line.partition(b" ")
        if key == b"max":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _tasks(dir_fd: int) -> int:
    try:
        fd = os.open("pids.current", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return 0
    try:
        return int(os.read(fd, 64) or b"0")
    except (OSError, ValueError):
        return 0
    finally:
        os.close(fd)


def _members(dir_fd: int) -> set[int]:
    try:
        fd = os.open("cgroup.procs", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return set()
    try:
        chunks = []
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return {int(p) for p in b"".join(chunks).split() if p.isdigit()}


def _write(dir_fd: int, name: str, value: str) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)
