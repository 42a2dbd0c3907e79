"""One long-lived child process (the Python runner or the bash loop) and its four pipes.

fd 1 and fd 2 of the child are pipes the agent reads continuously into bounded
captures; requests go down one control pipe and completions come back up
another, so program output can never be mistaken for framing. The child runs in
a session of its own (`setsid`) and is hardened between fork and exec (the shell) or
hardens itself before it reads a request (the runner, which the agent then verifies).

Exit statuses come from the agent's one `ChildReaper`; nothing here calls
`Popen.wait`, which would race it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field

from sandpool.agent import procs
from sandpool.agent.capture import StreamCapture
from sandpool.agent.template_channel import TemplateChannel
from sandpool.core.fds import until_ready

log = logging.getLogger("sandpool.agent.worker")

_READ_CHUNK = 65536
STATUS_GRACE_SECONDS = 1.0
"""How long after a template's runner exited its status may take to come from the template."""


class WorkerDied(Exception):
    """The child exited (or broke its control channel) while a call ran."""

    def __init__(self, return_code: int | None) -> None:
        super().__init__(f"worker exited with {return_code}")
        self.return_code = return_code


@dataclass
class CallOutput:
    stdout: StreamCapture
    stderr: StreamCapture
    done: asyncio.Future[bytes] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


EventParser = Callable[[bytearray], "bytes | None"]
"""Takes one complete event off the front of the buffer (mutating it), or returns None."""


class Worker:
    def __init__(self, name: str, argv: list[str], *, cwd: str, env: dict[str, str],
                 preexec: Callable[[], None] | None, child_reaper: procs.ChildReaper, parse_event: EventParser,
                 max_event_bytes: int = 1 << 20, extra_fds_in_argv: bool = True) -> None:
        self.name = name
        self._argv = argv
        self._cwd = cwd
        self._env = env
        self._preexec = preexec
        self._child_reaper = child_reaper
        self._parse_event = parse_event
        self._max_event_bytes = max_event_bytes
        self._extra_fds_in_argv = extra_fds_in_argv
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = 0
        self._pidfd: int | None = None
        self._own_child = True
        self._fds: dict[str, int] = {}
        self._events = bytearray()
        self._pending: list[bytes] = []
        self._waiter: asyncio.Future[bytes] | None = None
        self.current: CallOutput | None = None
        self.seq = 0
        """Requests sent so far; completions carry the number of the request they finish."""
        self.dead = False
        self.return_code: int | None = None
        self.output_lost = False
        """fd 1 or 2 of the child reached end-of-file while the child may live on: its output
        could no longer be captured, so it is replaced (the runner and the shell keep copies of
        both pipes, so only a program that closed those too gets here)."""

    # --- lifecycle ------------------------------------------------------------------------

    def spawn(self) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        req_r, req_w = os.pipe()
        ev_r, ev_w = os.pipe()
        argv = self._argv + ([str(req_r), str(ev_w)] if self._extra_fds_in_argv else [])
        try:
            self.proc = subprocess.Popen(  # argv is ours, never the caller's
                argv, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, pass_fds=(req_r, ev_w),
                cwd=self._cwd, env=self._env, start_new_session=True, preexec_fn=self._preexec,
                close_fds=True)
        except BaseException:
            for fd in (out_r, err_r, req_w, ev_r):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, req_r, ev_w):
                os.close(fd)
        self.adopt(self.proc.pid)
        self._attach(out_r, err_r, req_w, ev_r)

    def spawn_from(self, template: TemplateChannel) -> None:
        """Have the zygote's runner template fork the child; its pid comes in its first event (`adopt`)."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        req_r, req_w = os.pipe()
        ev_r, ev_w = os.pipe()
        devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            template.request([devnull, out_w, err_w, req_r, ev_w])
        except BaseException:
            for fd in (out_r, err_r, req_w, ev_r):
                os.close(fd)
            raise
        finally:
            for fd in (devnull, out_w, err_w, req_r, ev_w):
                os.close(fd)
        self._attach(out_r, err_r, req_w, ev_r)

    def adopt(self, pid: int, *, own_child: bool = True) -> None:
        """The child's pid (in this sandbox's PID namespace), which its exit status is reported for.

        Not `own_child`: a runner the zygote's template forked, whose parent (the template) reaps
        it and reports its status. A pidfd then tells whether it still lives, so no signal meant
        for it can reach a later process given the same pid, and a status that never comes (the
        template died) does not keep the pid watched for good."""
        if not own_child:
            self._pidfd = os.pidfd_open(pid)  # first: a pid already gone is never watched
            self._own_child = False
        self.pid = pid
        self._child_reaper.watch(pid)

    def _gone(self) -> bool:
        """Whether a child not our own has exited (its pidfd is readable, or closed with the
        worker); False for our own, whose pid stays ours until we reap it."""
        if self._own_child:
            return False
        return self._pidfd is None or bool(select.select([self._pidfd], [], [], 0)[0])

    def _attach(self, out_r: int, err_r: int, req_w: int, ev_r: int) -> None:
        loop = asyncio.get_running_loop()
        self._fds = {"stdout": out_r, "stderr": err_r, "req": req_w, "ev": ev_r}
        for fd in (out_r, err_r, ev_r, req_w):
            os.set_blocking(fd, False)
        loop.add_reader(out_r, self._on_output, "stdout")
        loop.add_reader(err_r, self._on_output, "stderr")
        loop.add_reader(ev_r, self._on_event)

    async def next_event(self, timeout: float | None = None) -> bytes:
        """The next completion/ready event; raises WorkerDied when the channel closes."""
        if self._pending:
            return self._pending.pop(0)
        if self.dead:
            raise WorkerDied(self.return_code)
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(self._waiter), timeout)
        finally:
            self._waiter = None

    def forget_events(self) -> None:
        """Drop completions nobody waits for (a program may forge them on its own channel)."""
        self._pending.clear()
        self._events.clear()

    async def send(self, data: bytes) -> None:
        """Write a request without ever blocking the event loop (a stopped child may not be reading)."""
        view = memoryview(data)
        while view:
            fd = self._fds.get("req")
            if fd is None:
                return
            try:
                view = view[os.write(fd, view):]
                continue
            except BlockingIOError:
                pass
            except OSError:
                return  # the child died; the event channel reports it
            await until_ready(fd, write=True)

    # --- readers --------------------------------------------------------------------------

    def _on_output(self, stream: str) -> None:
        fd = self._fds.get(stream)
        if fd is None:
            return
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_fd(stream)
            return
        if self.current is not None:
            getattr(self.current, stream).feed(data)

    def drain_output(self) -> None:
        """Read what is already in the output pipes (after a completion), without waiting for more."""
        for stream in ("stdout", "stderr"):
            for _ in range(256):  # bounded: a grandchild may be writing as fast as we read
                fd = self._fds.get(stream)
                if fd is None:
                    break
                try:
                    data = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    break
                except OSError:
                    data = b""
                if not data:
                    self._close_fd(stream)
                    break
                if self.current is not None:
                    getattr(self.current, stream).feed(data)

    def _on_event(self) -> None:
        fd = self._fds.get("ev")
        if fd is None:
            return
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_fd("ev")
            self._mark_dead()
            return
        self._events += data
        if len(self._events) > self._max_event_bytes:
            log.warning("worker control channel overflow", extra={"worker": self.name})
            self._events.clear()
            self.kill()
            return
        while True:
            try:
                event = self._parse_event(self._events)
            except ValueError:
                log.warning("worker control channel garbled", extra={"worker": self.name})
                self._events.clear()
                self.kill()
                return
            if event is None:
                break
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(event)
            else:
                self._pending.append(event)

    def _mark_dead(self) -> None:
        if self.dead:
            return
        self.dead = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(WorkerDied(None))

    def _close_fd(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is None:
            return
        if name in ("stdout", "stderr"):
            self.output_lost = True
        if name != "req":
            try:
                asyncio.get_running_loop().remove_reader(fd)
            except RuntimeError:
                pass
        os.close(fd)

    # --- signals and teardown -------------------------------------------------------------

    def interrupt(self) -> None:
        """SIGINT to the child's process group (its foreground work)."""
        if self.pid and not self._gone():
            procs.kill_group(self.pid, signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL the child and everything below it."""
        if self.pid and not self._gone():
            procs.kill_group(self.pid, signal.SIGKILL)
            procs.kill_trees({self.pid}, keep=self._child_reaper.watched - {self.pid}, include_roots=True)
        self._mark_dead()

    def kill_descendants(self) -> None:
        """SIGKILL everything this child started (and the agent's orphans), keeping the child itself."""
        if self.pid and not self.dead and not self._gone():
            procs.kill_trees({self.pid}, keep=set(self._child_reaper.watched), include_roots=False)

    async def wait_exit(self, timeout: float = 2.0) -> int | None:
        """The exit code once the process is reaped (None if it did not exit in time)."""
        if self.return_code is not None or not self.pid:  # no pid: a template's child that never said it
            return self.return_code
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        gone_at: float | None = None
        while True:
            code = self._child_reaper.exit_code(self.pid)
            if code is None and self._gone():
                gone_at = gone_at if gone_at is not None else loop.time()
                if loop.time() - gone_at > STATUS_GRACE_SECONDS:  # its status is not coming
                    self._child_reaper.forget(self.pid)
                    return None
            if code is not None:
                self.return_code = code
                if self.proc is not None:
                    self.proc.returncode = code  # so Popen never waits on a reaped pid
                return code
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        """Kill the child, reap it and release every pipe."""
        self.kill()
        await self.wait_exit(timeout=2.0)
        self.drain_output()
        for name in list(self._fds):
            self._close_fd(name)
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
