"""The zygote's client in the controller, and the local provider's `ZygoteLauncher`.

The controller starts one zygote (`zygote_server`) as its child (or, with
`--sandboxes-outlive-controller`, adopts the one an earlier controller left
running) and asks it, over a private socketpair, to fork one namespaced,
cgroup-limited agent per sandbox.
A launch costs the fork and the namespace/mount set-up (milliseconds) instead of
a new interpreter's imports (a quarter of a CPU-second), which is what lets the
pool refill faster than clients release sessions.

The zygote is started with a scrubbed environment (no `SANDPOOL_*`, no
credentials), from the event-loop thread (PDEATHSIG follows the thread that
forked it, so a worker thread's exit must not kill it), and its stdout goes to
stderr so nothing a sandbox prints reaches the controller's stdout.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import sandpool
from sandpool.core.fds import until_ready
from sandpool.core.settings import ConfigurationError
from sandpool.providers.local import zygote_protocol
from sandpool.providers.local.isolation import mounts
from sandpool.providers.local.isolation.detect import TOGGLEABLE, IsolationReport
from sandpool.providers.local.launcher import AgentSecret, Launcher, SandboxLimits, SubprocessLauncher
from sandpool.providers.local.procs import ProcessHandle, kill_tree, start_time

log = logging.getLogger("sandpool.providers.local.zygote")

# Tasks the agent itself (its threads, the children it is forking) has beyond the code's
# process cap: the sandbox's total pids.max is the cap plus this.
AGENT_TASKS = 64


KillOutcome = Literal["unknown", "killed", "contained"]
"""What a kill found: no such sandbox, killed, or killed with everything it ran provably gone
(its PID namespace or cgroup emptied by the kernel, so no /proc scan for leftovers is needed)."""


class ZygoteError(Exception):
    """The zygote could not start or could not do what was asked."""


class ZygoteClient:
    """Owns the zygote process and the request/reply channel to it."""

    def __init__(self, run_dir: Path | None = None, *, disabled: frozenset[str] = frozenset(),
                 cgroup_version: str = "auto", start_timeout: float = 30.0, request_timeout: float = 30.0,
                 python: str | None = None, extra_paths: tuple[str, ...] = (), netns_spares: int = 32,
                 runner_template: bool = True) -> None:
        # Holds only the empty directory each sandbox mounts its new root on. Default: a
        # private temporary directory of this zygote's own, removed when it stops.
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._own_run_dir = run_dir is None
        self.disabled = disabled
        self.cgroup_version = cgroup_version
        self.start_timeout = start_timeout
        self.request_timeout = request_timeout
        self.python = python or sys.executable
        # Host directories bound read-only into every sandbox root beyond the system's and sandpool's
        # own Python (the sandbox environments: docs/sandboxes.md).
        self.extra_paths = tuple(extra_paths)
        self.netns_spares = netns_spares
        self.runner_template = runner_template
        self.report: IsolationReport | None = None
        self.cgroup_bases: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._hello: asyncio.Future[dict[str, Any]] | None = None
        # Sandboxes that died on their own (most recent last), for logs and debugging.
        self.exits: collections.deque[dict[str, Any]] = collections.deque(maxlen=1000)
        # Told (with the sandbox id, on the event loop) when a sandbox exits on its own.
        self.on_exit: Callable[[str], None] | None = None
        self._closed = False
        self.listen: Path | None = None
        """Where a zygote that outlives its controller waits to be adopted (None: it dies with us)."""
        self.end_with_pid: int | None = None
        self.adopted = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self) -> IsolationReport:
        if self.proc is not None or self.sock is not None:
            raise ZygoteError("this zygote client was already started")
        if self.listen is not None:
            adopted = await self._adopt()
            if adopted is not None:
                return adopted
        if self.run_dir is None:
            _sweep_run_dirs()
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"sandpool-zygote-{os.getpid()}-"))
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.run_dir, 0o700)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config = {"disabled": sorted(self.disabled), "run_dir": str(self.run_dir),
                  "cgroup_version": self.cgroup_version, "extra_paths": list(self.extra_paths),
                  "netns_spares": self.netns_spares, "runner_template": self.runner_template}
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
               "PYTHONPATH": str(Path(sandpool.__file__).resolve().parent.parent),
               "PYTHONDONTWRITEBYTECODE": "1", "MALLOC_ARENA_MAX": "2"}
        try:
            # Popen, not asyncio's subprocess: it must be forked from this (the loop's) thread.
            self.proc = subprocess.Popen(  # noqa: ASYNC220 - see above; it returns once forked
                [self.python, "-m", "sandpool.providers.local.zygote_server", "--fd", str(child.fileno()),
                 "--parent", str(os.getpid()), *(["--listen", str(self.listen)] if self.listen else []),
                 *(["--end-with-pid", str(self.end_with_pid)] if self.end_with_pid else [])],
                pass_fds=[child.fileno()], stdin=subprocess.DEVNULL, stdout=sys.stderr.fileno(),
                env=env, cwd=str(self.run_dir), start_new_session=True)
        except OSError as exc:
            parent.close()
            await self.close(keep=False)
            raise ZygoteError(f"the zygote did not start: {self.python}: {exc.strerror or exc}") from None
        finally:
            child.close()
        self.sock = parent
        try:
            zygote_protocol.send(parent, {"op": "configure", **config})
        except OSError as exc:  # it died before reading its configuration
            await self.close(keep=False)
            raise ZygoteError(f"the zygote did not start: {exc.strerror or exc}") from None
        return await self._greeted(parent)

    async def _greeted(self, sock: socket.socket) -> IsolationReport:
        """Read the zygote's hello on a fresh channel: its isolation and cgroups."""
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self._hello = loop.create_future()
        loop.add_reader(sock.fileno(), self._on_readable)
        try:
            hello = await asyncio.wait_for(asyncio.shield(self._hello), self.start_timeout)
        except (TimeoutError, ZygoteError) as exc:
            # One we started and that never said hello is ended, even one meant to outlive us; one we
            # only tried to adopt is not ours to end.
            await self.close(keep=self.adopted)
            raise ZygoteError(f"the zygote did not start: {exc or 'timed out'}") from None
        self.report = IsolationReport.from_dict(hello["isolation"])
        self.cgroup_bases = [str(p) for p in hello.get("cgroup_bases", [])]
        return self.report

    async def _adopt(self) -> IsolationReport | None:
        """Take over the zygote a previous controller left running (its sandboxes with it), if one
        listens; None when there is none to adopt."""
        assert self.listen is not None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(str(self.listen))
        except OSError:
            sock.close()
            return None
        self.sock, self.adopted = sock, True
        report = await self._greeted(sock)
        log.info("adopted the running zygote and its sandboxes", extra={"socket": str(self.listen)})
        return report

    def _on_readable(self) -> None:
        assert self.sock is not None
        while True:
            try:
                message, fds = zygote_protocol.recv(self.sock)
            except BlockingIOError:
                return
            except (OSError, zygote_protocol.ProtocolError) as exc:
                self._fail(f"zygote channel broken: {exc}")
                return
            for fd in fds:
                os.close(fd)
            if message is None:
                self._fail("the zygote exited")
                return
            self._dispatch(message)

    def _dispatch(self, message: dict[str, Any]) -> None:
        event = message.get("event")
        if event == "hello":
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(message)
            return
        if event == "exit":
            self.exits.append(message)
            log.info("sandbox exited on its own", extra={"sandbox_id": message.get("sandbox_id"),
                                                         "status": message.get("status")})
            sandbox_id = message.get("sandbox_id")
            if self.on_exit is not None and isinstance(sandbox_id, str):
                try:
                    self.on_exit(sandbox_id)
                except Exception:  # a listener's bug must not break the channel
                    log.exception("sandbox exit listener failed", extra={"sandbox_id": sandbox_id})
            return
        rid = message.get("id")
        future = self._pending.pop(rid, None) if isinstance(rid, int) else None
        if future is not None and not future.done():
            future.set_result(message)

    def _fail(self, reason: str) -> None:
        if self.sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
        error = ZygoteError(reason)
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(error)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        if not self._closed:
            log.error("zygote failed: %s", reason)
        self._closed = True

    @property
    def alive(self) -> bool:
        if self._closed:
            return False
        if self.adopted:  # not our child: its death shows as the channel's end
            return self.sock is not None
        return self.proc is not None and self.proc.poll() is None

    async def request(self, message: dict[str, Any], fds: tuple[int, ...] = (),
                      timeout: float | None = None) -> dict[str, Any]:
        if not self.alive or self.sock is None:
            raise ZygoteError("the zygote is not running")
        rid = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        data = zygote_protocol.encode({**message, "id": rid})
        try:
            await self._send(data, fds)
            return await asyncio.wait_for(future, timeout or self.request_timeout)
        except TimeoutError:
            raise ZygoteError(f"the zygote did not answer {message.get('op')} in time") from None
        finally:
            self._pending.pop(rid, None)

    async def _send(self, data: bytes, fds: tuple[int, ...]) -> None:
        assert self.sock is not None
        while True:
            try:
                zygote_protocol.send_raw(self.sock, data, fds)
                return
            except BlockingIOError:
                await until_ready(self.sock.fileno(), write=True)
            except OSError as exc:
                self._fail(f"cannot write to the zygote: {exc}")
                raise ZygoteError("the zygote is not running") from None

    async def launch(self, sandbox_id: str, *, socket_path: str, workspace: str | None, uid: int | None,
                     secret: str, limits: dict[str, int | None], agent: dict[str, Any],
                     log_path: str | None = None, egress_socket: str | None = None,
                     ready_fd: int | None = None) -> dict[str, Any]:
        fd = zygote_protocol.secret_fd(secret)
        message = {"op": "launch", "sandbox_id": sandbox_id, "socket_path": socket_path, "workspace": workspace,
                   "uid": uid, "limits": limits, "agent": agent, "log_path": log_path}
        if egress_socket is not None:
            message["egress_socket"] = egress_socket  # host path, bound read-only into the sandbox root
        try:
            reply = await self.request(message, (fd,) if ready_fd is None else (fd, ready_fd))
        finally:
            os.close(fd)
        if not reply.get("ok"):
            raise ZygoteError(str(reply.get("error") or "launch failed"))
        return reply

    async def kill(self, *, sandbox_id: str | None = None, pid: int | None = None) -> KillOutcome:
        """Kill a sandbox (by id or by its init's pid) and wait for it to be reaped."""
        reply = await self.request({"op": "kill", "sandbox_id": sandbox_id, "pid": pid})
        if not reply.get("ok"):
            raise ZygoteError(str(reply.get("error") or "kill failed"))
        if reply.get("gone"):
            return "unknown"
        return "contained" if reply.get("contained") else "killed"

    async def stats(self) -> dict[str, Any]:
        """CPU the zygote spent itself, and what reaped sandboxes (with everything they ran) spent."""
        return await self.request({"op": "stats"})

    async def list(self) -> list[dict[str, Any]]:
        reply = await self.request({"op": "list"})
        return list(reply.get("sandboxes") or [])

    async def shutdown(self) -> None:
        """End the zygote and every sandbox it made, even one that would outlive us."""
        if self.alive:
            with contextlib.suppress(ZygoteError):
                await self.request({"op": "shutdown"})
        await self.close(keep=False)

    async def close(self, timeout: float = 10.0, *, keep: bool | None = None) -> None:
        """Let go of the zygote. One that outlives us (`listen`) keeps its sandboxes for the next
        controller (unless `keep=False`); otherwise it kills every sandbox it made and removes
        their cgroups."""
        if keep is None:
            keep = self.listen is not None
        if self.sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            self.sock.close()
            self.sock = None
        self._closed = True
        self._fail("closed")
        if keep:
            return
        if self.adopted:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_gone(self.listen), timeout)
        if self.proc is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while self.proc.poll() is None and loop.time() < deadline:  # noqa: ASYNC110 - Popen's exit is not awaitable
                await asyncio.sleep(0.02)
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        if self.run_dir is not None and (self._own_run_dir or (self.listen is not None and not self.adopted)):
            shutil.rmtree(self.run_dir, ignore_errors=True)  # (a stable one too: its zygote is gone)
            self.run_dir = None
        # A zygote killed outright leaves empty groups behind (nested ones too): remove them.
        for base in self.cgroup_bases:
            for child in _subdirs(Path(base)):
                for group in sorted(child.glob("**/"), key=lambda p: len(p.parts), reverse=True):
                    with contextlib.suppress(OSError):
                        group.rmdir()
            with contextlib.suppress(OSError):
                Path(base).rmdir()


async def _gone(listen: Path | None) -> None:
    """Until a zygote's socket is gone (it removes it on its way out)."""
    while listen is not None and listen.exists():  # noqa: ASYNC110 - a path's removal is not awaitable
        await asyncio.sleep(0.02)


async def shutdown_listening(listen: Path) -> bool:
    """End a zygote that outlived its controller, with its sandboxes (`sandpool up` on its way
    out); False when none listens there."""
    client = ZygoteClient(listen.parent / "zygote-run")
    client.listen = listen
    try:
        if await client._adopt() is None:
            return False
    except ZygoteError:
        return False
    await client.shutdown()
    return True


def _sweep_run_dirs() -> None:
    """Remove the (empty) run directories of zygote clients that died without closing: a
    killed controller's zygote dies by PDEATHSIG before it can clean up. rmdir only: a
    directory with anything in it is left alone."""
    for path in Path(tempfile.gettempdir()).glob("sandpool-zygote-*-*"):
        owner = path.name.split("-")[2]
        if not owner.isdigit() or Path(f"/proc/{owner}").exists():
            continue
        for leftover in (path / "root", path):
            with contextlib.suppress(OSError):
                leftover.rmdir()


def _subdirs(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir()]
    except OSError:
        return []


class ZygoteLauncher:
    """`Launcher` for the local provider: agents forked from a warm zygote into their own namespaces.

    With a `fallback` (the `auto` choice), a zygote that cannot start at all hands every
    call to the fallback launcher, after a loud warning; without one, start fails.
    """

    def __init__(self, run_dir: Path | None = None, *, disabled: frozenset[str] = frozenset(),
                 cgroup_version: str = "auto", stop_grace_seconds: float = 2.0, python: str | None = None,
                 agent_options: dict[str, Any] | None = None, restart_interval: float = 5.0,
                 fallback: Launcher | None = None, netns_spares: int = 32, runner_template: bool = True) -> None:
        self._new_client = functools.partial(ZygoteClient, run_dir, disabled=disabled, cgroup_version=cgroup_version,
                                             python=python, netns_spares=netns_spares, runner_template=runner_template)
        self.client = self._new_client()
        self.stop_grace_seconds = stop_grace_seconds
        self.agent_options = dict(agent_options or {})
        self.extra_paths: tuple[str, ...] = ()
        """Host directories every sandbox sees read-only (set by the provider before `start`)."""
        self.report: IsolationReport | None = None
        self.restart_interval = restart_interval
        self.fallback = fallback
        self.using_fallback = False
        self._on_exit: Callable[[str], None] | None = None
        self.listen_path: Path | None = None
        """Set by the provider when sandboxes outlive their controller: where the zygote waits to be
        adopted (and a new controller looks for it first)."""
        self.end_with_pid: int | None = None
        """The process whose end ends that zygote and its sandboxes (`sandpool up`)."""
        self._last_start = 0.0
        self._starting: asyncio.Lock | None = None

    @property
    def on_exit(self) -> Callable[[str], None] | None:
        """Told (with the sandbox id) when a sandbox exits on its own; kept across zygote restarts."""
        return self._on_exit

    @on_exit.setter
    def on_exit(self, listener: Callable[[str], None] | None) -> None:
        self._on_exit = listener
        self.client.on_exit = listener

    async def start(self) -> IsolationReport | None:
        """Start the zygote and log its isolation (idempotent)."""
        if self.using_fallback or (self.report is not None and self.client.alive):
            return self.report
        self._last_start = asyncio.get_running_loop().time()
        self.client.extra_paths = self.extra_paths
        self._persist(self.client)
        try:
            self.report = await self.client.start()
        except ZygoteError as exc:
            if self.fallback is None:
                raise
            self.using_fallback = True
            log.warning("ISOLATION MISSING: the zygote could not start (%s); sandboxes are plain "
                        "subprocesses without namespaces, cgroups or a private root", exc)
            return None
        self.report.log()
        return self.report

    async def _ensure_running(self) -> None:
        """Start the zygote, or replace one that died (its sandboxes died with it), at most
        once per `restart_interval` so a zygote that cannot start is not retried in a loop."""
        if self.client.alive and self.report is not None:
            return
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.client.alive and self.report is not None:
                return
            loop = asyncio.get_running_loop()
            if self.report is not None and loop.time() - self._last_start < self.restart_interval:
                raise ZygoteError("the zygote died and was restarted moments ago")
            if self.report is not None:
                log.error("the zygote died; starting a new one")
                await self.client.close()
                self.client = self._new_client()
                self.client.on_exit = self._on_exit
                self._persist(self.client)
            await self.start()

    def _persist(self, client: ZygoteClient) -> None:
        if self.listen_path is not None and client.listen is None:
            client.listen = self.listen_path
            client.end_with_pid = self.end_with_pid
            client.run_dir = self.listen_path.parent / "zygote-run"  # stable: the next controller's too
            client._own_run_dir = False

    async def aclose(self) -> None:
        await self.client.close()

    async def launch(self, sandbox_id: str, workspace: Path, socket_path: Path, secret: AgentSecret,
                     limits: SandboxLimits, *, log_path: Path, ready_fd: int | None = None) -> ProcessHandle:
        if not self.using_fallback:
            await self._ensure_running()  # may find that only the fallback can start sandboxes
        if self.using_fallback and self.fallback is not None:
            return await self.fallback.launch(sandbox_id, workspace, socket_path, secret, limits, log_path=log_path,
                                              ready_fd=ready_fd)
        assert self.report is not None
        # With the filesystem layer, the socket's directory (holding nothing but the socket) is the
        # one host directory the sandbox sees.
        agent = {"log_level": "warning", **self.agent_options}
        if limits.max_processes and limits.uid is not None:
            agent["rlimit_nproc"] = limits.max_processes
        if limits.max_open_files:
            agent["rlimit_nofile"] = limits.max_open_files
        if limits.max_file_size_bytes:
            agent["rlimit_fsize_bytes"] = limits.max_file_size_bytes
        if limits.memory_bytes:
            agent["rlimit_as_bytes"] = limits.memory_bytes
        sandbox_python = getattr(limits, "sandbox_python", None)
        if sandbox_python:
            agent["python_executable"] = sandbox_python
        if getattr(limits, "matplotlib_cache", None):
            agent["matplotlib_cache"] = limits.matplotlib_cache
        if getattr(limits, "preimport", ()):
            agent["preimport"] = list(limits.preimport)
        egress = getattr(limits, "egress", None)
        if egress is not None:
            # The agent relays to the socket where the sandbox sees it: bound at a fixed path in its own
            # root, or the host's path when there is no private root.
            agent["egress_socket"] = (mounts.EGRESS_SOCKET if self.report.is_active("filesystem")
                                      else egress.socket)
            agent["egress_credential"] = egress.credential
        uid = limits.uid if self.report.is_active("unprivileged_uid") else None
        reply = await self.client.launch(
            sandbox_id, socket_path=str(socket_path), workspace=str(workspace), uid=uid, secret=secret.value,
            limits={"memory_bytes": limits.memory_bytes,
                    "pids_max": (limits.max_processes + AGENT_TASKS) if limits.max_processes else None,
                    "code_pids_max": limits.max_processes or None,
                    "cpu_millis": getattr(limits, "cpu_millis", None),
                    "workspace_bytes": limits.workspace_bytes},
            agent=agent, log_path=str(log_path), egress_socket=egress.socket if egress is not None else None,
            ready_fd=ready_fd)
        pid = int(reply["pid"])
        return ProcessHandle(pid=pid, pgid=pid, start_time=start_time(pid))

    async def kill(self, handle: ProcessHandle) -> bool:
        if self.using_fallback and self.fallback is not None:
            return await self.fallback.kill(handle)
        if self.client.alive:
            try:
                outcome = await self.client.kill(pid=handle.pid)
                if outcome != "unknown":
                    return outcome == "contained"
            except ZygoteError:
                pass
        # Not one of this zygote's (an earlier controller's, or the zygote is gone).
        await kill_tree(handle, grace=0)
        return False

    def describe(self) -> dict[str, object]:
        if self.using_fallback and self.fallback is not None:
            return {**self.fallback.describe(), "zygote": "could not start"}
        report = self.report
        return {
            "launcher": "zygote",
            "namespaces": bool(report and report.is_active("namespaces")),
            # The workspace cap is a tmpfs mounted inside the sandbox's mount namespace.
            "caps_workspace": bool(report and report.is_active("filesystem")),
            "isolation": report.to_dict() if report else None,
            "zygote_pid": self.client.pid,
        }


LAUNCHERS = ("auto", "zygote", "subprocess")


def make_launcher(settings: Any) -> Launcher:
    """The launcher the local provider's settings ask for.

    Reads `launcher` (`auto` | `zygote` | `subprocess`, default `auto`) and
    `isolation_disable` (layers to turn off) when the settings have them. `auto` is
    the zygote on Linux, falling back to plain subprocesses if it cannot start.
    """
    choice = getattr(settings, "launcher", "auto") or "auto"
    disabled = frozenset(getattr(settings, "isolation_disable", None) or ())
    if choice not in LAUNCHERS:
        raise ConfigurationError(f"--launcher / SANDPOOL_LAUNCHER: {choice!r} is not one of {', '.join(LAUNCHERS)}")
    unknown = sorted(disabled - set(TOGGLEABLE))
    if unknown:
        raise ConfigurationError(f"--isolation-disable / SANDPOOL_ISOLATION_DISABLE: unknown layer(s) "
                                 f"{', '.join(unknown)}; choose from {', '.join(TOGGLEABLE)}")
    plain = SubprocessLauncher(settings.agent_python, stop_grace_seconds=settings.stop_grace_seconds)
    if choice == "subprocess" or (choice == "auto" and not sys.platform.startswith("linux")):
        return plain
    return ZygoteLauncher(None, disabled=disabled,
                          stop_grace_seconds=settings.stop_grace_seconds, python=settings.agent_python,
                          fallback=plain if choice == "auto" else None,
                          netns_spares=getattr(settings, "netns_spares", 32),
                          runner_template=getattr(settings, "runner_template", True))
