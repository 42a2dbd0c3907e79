"""How the local provider starts a sandbox's agent: a small protocol and its first implementation.

The provider prepares the sandbox (directory, workspace, secret file, uid) and
hands a `Launcher` what to start; the launcher decides how (a plain subprocess
here; a namespaced fork from a warm template in `isolation/`). Whatever the
launcher, the result is a `ProcessHandle` the provider records on disk, so a
restarted provider can still find and kill the sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

import sandpool
from sandpool.providers.local.procs import EXIT_WAIT_SECONDS, ProcessHandle, kill_tree, start_time


@dataclass(frozen=True)
class EgressAccess:
    """A sandbox's way out: the egress proxy's Unix socket (host path) and the sandbox's own credential."""

    socket: str
    credential: str = field(repr=False)


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandbox may use. `uid`/`gid` None: sandboxed code runs as the service's own user."""

    uid: int | None
    gid: int | None
    memory_bytes: int | None
    max_processes: int | None
    max_open_files: int | None
    max_file_size_bytes: int | None
    workspace_bytes: int | None
    sandbox_python: str | None = None  # the Python sandboxed code runs with (None: the agent's choice)
    matplotlib_cache: str | None = None  # the environment's pre-built matplotlib font cache
    preimport: tuple[str, ...] = ()  # modules the interpreter imports before the first call
    cpu_millis: int | None = None  # CPU quota in thousandths of a core (None: no quota); needs the zygote's cgroups
    spare_interpreter: bool | None = None  # None: the agent's default
    agent_log_level: str = "warning"
    egress: EgressAccess | None = None  # None: no egress (no credential, no relay)


@dataclass(frozen=True)
class AgentSecret:
    """The agent's per-sandbox secret: its value and the 0600 file (outside the workspace) holding it."""

    value: str = field(repr=False)
    file: Path


@runtime_checkable
class Launcher(Protocol):
    async def launch(self, sandbox_id: str, workspace: Path, socket_path: Path, secret: AgentSecret,
                     limits: SandboxLimits, *, log_path: Path, ready_fd: int | None = None) -> ProcessHandle:
        """Start the agent listening on `socket_path`, its output appended to `log_path` (0600);
        return as soon as it runs (not when it serves). The agent inherits `ready_fd` (the
        write end of the caller's pipe) as `--ready-fd` and says `ok` on it once it serves."""

    async def kill(self, handle: ProcessHandle) -> bool:
        """Kill the agent and every process it started. Idempotent. True when the kernel vouches that
        nothing the sandbox started survives (then nobody need scan for stragglers)."""

    def describe(self) -> dict[str, object]:
        """Which launcher, and what isolation it adds, for logs and /readyz."""


def agent_arguments(workspace: Path, socket_path: Path, secret: AgentSecret, limits: SandboxLimits) -> list[str]:
    """`sandpool agent` flags for a sandbox (the secret by file, never as a flag value)."""
    args = ["agent", "--uds", str(socket_path), "--workspace", str(workspace),
            "--secret-file", str(secret.file), "--log-level", limits.agent_log_level]
    if limits.uid is not None:
        args += ["--sandbox-uid", str(limits.uid), "--sandbox-gid", str(limits.gid or limits.uid)]
        if limits.max_processes:
            args += ["--rlimit-nproc", str(limits.max_processes)]
    if limits.spare_interpreter is not None:
        args.append("--spare-interpreter" if limits.spare_interpreter else "--no-spare-interpreter")
    if limits.sandbox_python:
        args += ["--python-executable", limits.sandbox_python]
    if limits.matplotlib_cache:
        args += ["--matplotlib-cache", limits.matplotlib_cache]
    if limits.preimport:
        args += ["--preimport", ",".join(limits.preimport)]
    if limits.max_open_files:
        args += ["--rlimit-nofile", str(limits.max_open_files)]
    if limits.max_file_size_bytes:
        args += ["--rlimit-fsize-bytes", str(limits.max_file_size_bytes)]
    if limits.memory_bytes:
        args += ["--rlimit-as-bytes", str(limits.memory_bytes)]
    if limits.egress is not None:
        args += ["--egress-socket", limits.egress.socket]  # the credential goes by environment
    return args


def agent_environment(workspace: Path, egress: EgressAccess | None = None, *,
                      tmp: Path | None = None) -> dict[str, str]:
    """A clean environment: nothing of the control plane's (credentials, Redis URL) reaches a sandbox;
    only the sandbox's own egress credential, when it has one. `tmp`: the agent's TMPDIR (its
    private matplotlib directory goes there), inside the sandbox's directory so that destroying the
    sandbox removes it even when the agent was killed -9; not the host's /tmp."""
    extra = {"SANDPOOL_EGRESS_CREDENTIAL": egress.credential} if egress is not None else {}
    if tmp is not None:
        extra["TMPDIR"] = str(tmp)
    return {
        **extra,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": str(workspace),
        "PYTHONPATH": str(Path(sandpool.__file__).resolve().parent.parent),
        "PYTHONUNBUFFERED": "1",
        "MALLOC_ARENA_MAX": "2",  # keeps thread arenas from eating an address-space limit
    }


class SubprocessLauncher:
    """`python -m sandpool agent ...` in a session of its own, as the service's user (the agent
    drops sandboxed code to the sandbox uid itself)."""

    def __init__(self, python: str | None = None, *, stop_grace_seconds: float = 2.0) -> None:
        self.python = python or sys.executable
        self.stop_grace_seconds = stop_grace_seconds
        self._started: dict[int, asyncio.subprocess.Process] = {}
        """The agents this launcher started, by pid: the event loop reaps them, and a kill waits for it."""

    async def launch(self, sandbox_id: str, workspace: Path, socket_path: Path, secret: AgentSecret,
                     limits: SandboxLimits, *, log_path: Path, ready_fd: int | None = None) -> ProcessHandle:
        # 0600: the agent's log is the control plane's, not the sandboxed code's, to read.
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        ready = ["--ready-fd", str(ready_fd)] if ready_fd is not None else []
        tmp = log_path.parent / "tmp"
        tmp.mkdir(exist_ok=True)
        tmp.chmod(0o711)  # the sandbox uid only passes through (its own directory is in it); not left to the umask
        try:
            proc = await asyncio.create_subprocess_exec(
                self.python, "-m", "sandpool", *agent_arguments(workspace, socket_path, secret, limits), *ready,
                stdin=asyncio.subprocess.DEVNULL, stdout=log_fd, stderr=log_fd,
                cwd=str(log_path.parent), env=agent_environment(workspace, limits.egress, tmp=tmp),
                start_new_session=True, close_fds=True, pass_fds=(ready_fd,) if ready_fd is not None else ())
        finally:
            os.close(log_fd)
        self._started = {pid: p for pid, p in self._started.items() if p.returncode is None}
        self._started[proc.pid] = proc
        return ProcessHandle(pid=proc.pid, pgid=proc.pid, start_time=start_time(proc.pid))

    async def kill(self, handle: ProcessHandle) -> bool:
        await kill_tree(handle, grace=self.stop_grace_seconds)
        proc = self._started.pop(handle.pid, None)
        if proc is not None:  # ours: gone once the loop has reaped it (its exit status read, its handle closed)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), EXIT_WAIT_SECONDS)
        return False  # a process tree is no container: a double-forked escapee is the uid scan's

    def describe(self) -> dict[str, object]:
        return {"launcher": "subprocess", "namespaces": False, "python": self.python}
