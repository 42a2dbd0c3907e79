"""Everything one agent owns while it serves: the children, the editor, the call lock.

Built and started by the app's lifespan, torn down (children killed) when it
ends. Calls run one at a time in arrival order: `asyncio.Lock` hands itself to
waiters first-in first-out, and exec and file operations share the one lock.

The interpreter starts (and is warmed) before the agent serves; the shell
starts on the first bash call. Most sessions run Python only, and a shell
costs every sandbox ~10 ms of CPU (a fork of the agent, bash's start and its
warm-up call); a session's first bash call pays that start instead, once
(~15-40 ms of latency on a busy 2-core host).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
from pathlib import Path

from sandpool.agent import egress, hardening, process_cap, procs, produced, seccomp
from sandpool.agent.calls import CallQueue
from sandpool.agent.editor import Editor
from sandpool.agent.execution import ChildStartFailed
from sandpool.agent.interpreter import Interpreter
from sandpool.agent.settings import AgentSettings
from sandpool.agent.shell import Shell
from sandpool.agent.template_channel import TemplateChannel
from sandpool.agent.workspace import Workspace
from sandpool.contract.models import (
    BASH_CODE_EXECUTION,
    CODE_EXECUTION,
    TEXT_EDITOR_CODE_EXECUTION,
    parse_exec_request,
)

log = logging.getLogger("sandpool.agent")


class Runtime:
    def __init__(self, settings: AgentSettings, workspace: str | Path) -> None:
        self.settings = settings
        self.policy = hardening.ChildPolicy.from_settings(settings)
        self.workspace = Workspace(workspace, owner=(self.policy.uid, self.policy.gid))
        self.lock = asyncio.Lock()
        self.calls = CallQueue(self.lock)
        self.child_reaper = procs.ChildReaper()
        self.mplconfigdir = hardening.matplotlib_dir(settings.matplotlib_cache, self.policy)
        env = hardening.child_env(str(workspace), python=settings.sandbox_python(), mplconfigdir=self.mplconfigdir)
        self.egress = egress.from_settings(settings, str(workspace))  # None without egress: nothing runs
        if self.egress is not None:
            env.update(self.egress.environment(env["PATH"]))
        self.cap: process_cap.CodeCgroup | None = None
        preexec = hardening.preexec(self.policy, lambda: self.cap.join_fd if self.cap is not None else -1)
        self.interpreter = Interpreter(
            python=settings.sandbox_python(), workspace=str(workspace), env=env, preexec=preexec,
            harden=hardening.self_hardening(self.policy, settings.sandbox_python()), child_reaper=self.child_reaper,
            max_output_bytes=settings.max_output_bytes, grace_seconds=settings.interrupt_grace_seconds,
            spare=settings.spare_interpreter, preimport=tuple(settings.preimport),
            template=TemplateChannel(settings.runner_template_fd, self.child_reaper)
            if settings.runner_template_fd is not None else None)
        self.shell = Shell(
            bash=settings.shell, workspace=str(workspace), env=env, preexec=preexec, child_reaper=self.child_reaper,
            max_output_bytes=settings.max_output_bytes, grace_seconds=settings.interrupt_grace_seconds)
        self.editor = Editor(self.workspace, history=settings.editor_history, max_bytes=settings.max_read_bytes)
        self._reap_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if seccomp.native_arch() is None:
            log.warning("no seccomp filter on this architecture: sandboxed code keeps every system call")
        if not procs.proc_matches_this_namespace():
            log.warning("/proc belongs to another PID namespace: timeouts kill process groups only")
        if not self.policy.drops_privileges:
            log.warning("sandboxed code runs as the agent's own uid (no --sandbox-uid, or not root)")
        hardening.prepare_workspace(str(self.workspace.root), self.policy)
        self.cap = process_cap.from_settings(self.settings, self.child_reaper.reap)
        for child in (self.interpreter, self.shell):
            child.cap = self.cap
            child.keep = lambda: set(self.child_reaper.watched)
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGCHLD, self.child_reaper.reap)
        except (ValueError, RuntimeError):  # not the main thread: the periodic reap below covers it
            pass
        self._reap_task = asyncio.create_task(self._reap_forever())
        if not os.access(self.settings.shell, os.X_OK):
            raise ChildStartFailed(f"the shell {self.settings.shell} is not an executable file")
        if self.egress is not None:
            await self.egress.start()
        await self.interpreter.start()
        self._warm()
        self.interpreter.start_spare()

    def _warm(self) -> None:
        """Pay first-call costs now, so the first real call is as fast as the tenth. The
        interpreter's own first call is the app's self-test (a real Execute through every layer)."""
        parse_exec_request({"tool": CODE_EXECUTION, "input": {"code": "pass"}})
        parse_exec_request({"tool": BASH_CODE_EXECUTION, "input": {"command": ":"}})
        parse_exec_request({"tool": TEXT_EDITOR_CODE_EXECUTION, "input": {"command": "view", "path": "."}})
        produced.snapshot(self.workspace.root, 1)

    async def _reap_forever(self) -> None:
        while True:
            self.child_reaper.reap()
            if self.cap is not None and self.cap.background:
                self.cap.check_background()  # what earlier calls left running, hitting the cap between calls
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        await asyncio.gather(self.interpreter.close(), self.shell.close(), return_exceptions=True)
        if self.egress is not None:
            await self.egress.aclose()
        procs.kill_trees(set(), keep=set(), include_roots=False)  # whatever sandboxed code left behind
        self.child_reaper.reap()
        if self.mplconfigdir is not None:
            shutil.rmtree(self.mplconfigdir, ignore_errors=True)
        if self._reap_task is not None:
            self._reap_task.cancel()
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)
        except (ValueError, RuntimeError):
            pass

    def stop_now(self) -> None:
        """On SIGTERM/SIGINT: kill every child at once so in-flight calls end and shutdown is prompt."""
        self.interpreter.stop_now()
        self.shell.stop_now()
        procs.kill_trees(set(), keep=set(), include_roots=False)

    async def cancel(self, call_id: str | None = None) -> str | None:
        """Cancel the call `call_id` (stopped if it runs, withdrawn if it waits), or with none named the
        call running now; the id of the call cancelled, None when there was none to cancel."""
        running = self.calls.running()
        if call_id is not None and call_id != running:
            return call_id if self.calls.withdraw(call_id) else None
        if running is None:
            return None
        for child in (self.interpreter, self.shell):
            if child.running:
                return running if await child.cancel() else None
        return None

    def clamp_timeout(self, requested: int | None) -> float:
        if requested is None:
            return self.settings.exec_timeout_seconds
        return float(min(requested, self.settings.max_exec_timeout_seconds))

    @property
    def pid(self) -> int:
        return os.getpid()
