"""The zygote: a pre-initialised, single-threaded template that forks one sandbox per request.

Why: starting an agent as a new interpreter costs ~0.25 CPU-seconds of imports
(FastAPI, pydantic, uvicorn) per sandbox. The zygote pays that once; a fork
copies page tables, not work, so a sandbox costs a few milliseconds. bubblewrap
would give the same namespaces, but it execs a program, which means paying the
interpreter start again for every sandbox.

It is started by the controller (`python -m sandpool.providers.local.zygote_server
--fd N`) as its child, with a scrubbed environment; it talks over the inherited
socketpair (see `zygote_protocol`). Plain, it dies with its parent (PDEATHSIG)
and on end-of-stream kills every sandbox it made, removes their cgroups and
exits. With `--listen PATH` it outlives its parent instead: on end-of-stream it
keeps its sandboxes and waits on that socket (0600, its own uid only) for the
next controller to adopt it; `shutdown` ends it and every sandbox.

It must stay single-threaded: forking a threaded process copies locks held by
threads that do not exist in the child.

Per launch: create the cgroup, fork into a new PID namespace (unshare
CLONE_NEWPID, fork, setns back, so the child is PID 1 there and still our own
child), and reply when the child reports its isolation is in place. Killing a
sandbox kills its PID-namespace init, which takes every process inside with it;
the zygote reaps it and removes its cgroups. Sandbox pids are only ever reaped
here, so a pid the zygote signals cannot have been reused.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import logging
import os
import re
import resource
import selectors
import signal
import socket
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from sandpool.core.logs import configure_logging

from . import zygote_child, zygote_protocol
from .isolation import detect as detection
from .isolation import linux, mounts
from .isolation.cgroups import CgroupManager, SandboxCgroup
from .isolation.netns import NetNamespace, NetnsPool
from .runner_templates import RunnerTemplates

log = logging.getLogger("sandpool.zygote")

SANDBOX_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MIB = 1024 * 1024

# Imported before the first fork so that no sandbox pays for them.
PRELOAD = (
    "sandpool.agent.settings", "sandpool.agent.hardening", "sandpool.agent.seccomp",
    "sandpool.agent.app", "sandpool.agent.server",
    "uvicorn", "uvicorn.config", "uvicorn.server", "uvicorn.main",
    "uvicorn.protocols.http.httptools_impl", "uvicorn.protocols.http.h11_impl",
    "uvicorn.lifespan.on", "uvicorn.loops.auto", "uvicorn.loops.asyncio", "uvicorn.loops.uvloop",
    "asyncio.unix_events", "multipart", "python_multipart",
    # Imported lazily by the agent's first run_in_threadpool and its lifespan (found by diffing
    # sys.modules across a forked agent's start-up).
    "anyio._backends._asyncio", "anyio.streams.memory", "anyio.streams.stapled", "anyio.streams.tls",
    "anyio._core._sockets", "anyio._core._streams", "anyio.abc._subprocesses", "anyio.abc._testing",
    "fastapi.telemetry._runtime",
)


@dataclass
class Sandbox:
    sandbox_id: str
    pid: int
    uid: int | None
    cgroup: SandboxCgroup | None
    started: float
    status_fd: int | None = None
    netns: NetNamespace | None = None
    launch_request: int | None = None
    kill_requests: list[int] = field(default_factory=list)
    status: str = "starting"


@dataclass(frozen=True)
class ZygoteConfig:
    disabled: frozenset[str]
    run_dir: str
    uid_probe: int = 65534
    cgroup_version: str = "auto"
    extra_paths: tuple[str, ...] = ()
    netns_spares: int = 32
    runner_template: bool = True

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ZygoteConfig:
        return cls(disabled=frozenset(data.get("disabled", ())), run_dir=data["run_dir"],
                   uid_probe=int(data.get("uid_probe", 65534)),
                   cgroup_version=data.get("cgroup_version", "auto"),
                   extra_paths=tuple(data.get("extra_paths", ())),
                   netns_spares=max(0, int(data.get("netns_spares", 32))),
                   runner_template=bool(data.get("runner_template", True)))


class Zygote:
    def __init__(self, sock: socket.socket, config: ZygoteConfig, listener: socket.socket | None = None) -> None:
        self.sock: socket.socket | None = sock
        self.listener = listener
        self.owner_fd: int | None = None
        self.config = config
        self.sandboxes: dict[str, Sandbox] = {}
        self.by_pid: dict[int, Sandbox] = {}
        self.selector = selectors.DefaultSelector()
        self.report: detection.IsolationReport | None = None
        self.cgroups: CgroupManager | None = None
        self.plan: mounts.RootPlan | None = None
        self.root_template: int | None = None  # the template mount namespace (isolation/mounts.py)
        self.layers: frozenset[str] = frozenset()
        self.new_root = os.path.join(config.run_dir, "root")
        self.host_pidns: int | None = None
        self.netns: NetnsPool | None = None
        self.templates: RunnerTemplates | None = None
        self.netns_checked = 0.0
        self.wake_r, self.wake_w = os.pipe()
        self.running = True

    # -- start ---------------------------------------------------------------------------
    def prepare(self) -> None:
        os.makedirs(self.new_root, mode=0o700, exist_ok=True)
        self.report, self.cgroups = detection.detect(self.config.disabled, uid_probe=self.config.uid_probe,
                                                     cgroup_version=self.config.cgroup_version)
        self.layers = frozenset(self.report.active)
        if "filesystem" in self.layers:
            self.plan = mounts.plan_root(self.config.extra_paths,
                                         exclude=(os.path.realpath(self.config.run_dir),))
        if "namespaces" in self.layers:
            self.host_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self._prepare_root_template()
        if "network" in self.layers:
            self.netns = NetnsPool(spares=self.config.netns_spares)
        if self.config.runner_template and self.host_pidns is not None and hasattr(os, "pidfd_open") \
                and {"unprivileged_uid", "seccomp"} <= self.layers:
            flags = linux.CLONE_NEWPID | linux.CLONE_NEWNS | linux.CLONE_NEWIPC | linux.CLONE_NEWUTS \
                | linux.CLONE_NEWCGROUP | (linux.CLONE_NEWNET if "network" in self.layers else 0)
            self.templates = RunnerTemplates(flags=flags, keep_caps=zygote_child.AGENT_CAPS)
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        try:
            _warm_agent()
        except Exception as exc:  # noqa: BLE001 - a cold start is slower, not wrong
            log.warning("could not pre-warm the agent in the zygote: %s", exc)
        # Objects that exist now are never collected: the GC will not touch (and so
        # copy) their pages in every sandbox.
        gc.collect()
        gc.freeze()
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            log.warning("the zygote has %d threads after warm-up; forking it is unsafe", threads)

    def _prepare_root_template(self) -> None:
        """Build the read-only part of every sandbox root once (isolation/mounts.py); without it (no
        open_tree/move_mount, Linux < 5.2) each sandbox builds its whole root."""
        if self.root_template is not None:
            os.close(self.root_template)
            self.root_template = None
        if self.plan is None or not {"filesystem", "namespaces"} <= self.layers:
            return
        try:
            os.close(linux.open_tree_clone(self.new_root))  # a sandbox needs open_tree and move_mount
            self.root_template = mounts.prepare_template(self.plan, self.new_root)
        except OSError as exc:
            log.warning("no shared sandbox root (%s): each sandbox builds its own", exc)

    # -- loop ----------------------------------------------------------------------------
    def serve(self) -> None:
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "running", False))
        assert self.sock is not None
        self.selector.register(self.sock, selectors.EVENT_READ, "control")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "signal")
        if self.listener is not None:
            self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.hello()
        while self.running:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "control":
                    self.on_control()
                elif key.data == "listen":
                    self.adopt()
                elif key.data == "owner":
                    log.info("the process the sandboxes end with has ended; ending them")
                    self.running = False
                elif key.data == "signal":
                    try:
                        while os.read(self.wake_r, 512):
                            pass
                    except BlockingIOError:
                        pass
                    self.reap()
                else:
                    self.on_status(key.data)
            self.reap()
            self.recheck_netns()
        self.shutdown()

    def watch_end_of(self, pidfd: int) -> None:
        """End every sandbox and this zygote when the process behind `pidfd` ends."""
        os.set_inheritable(pidfd, False)
        self.owner_fd = pidfd
        self.selector.register(pidfd, selectors.EVENT_READ, "owner")

    def hello(self) -> None:
        assert self.report is not None
        self.send({"event": "hello", "pid": os.getpid(), "isolation": self.report.to_dict(),
                   "cgroup_bases": [str(p) for p in (self.cgroups.bases.values() if self.cgroups else ())]})

    def adopt(self) -> None:
        """A controller connects to take this zygote over: served if its uid is ours and no other
        controller holds the zygote now."""
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
        uid = int.from_bytes(creds[4:8], sys.byteorder)
        if uid != os.getuid() or self.sock is not None:
            conn.close()
            return
        self.sock = conn
        self.selector.register(conn, selectors.EVENT_READ, "control")
        log.info("adopted by a new controller; %d sandboxes kept", len(self.sandboxes))
        self.hello()

    def lost_client(self) -> None:
        """The controller went away: keep the sandboxes and wait for the next one (with a listener),
        or end everything (without)."""
        if self.listener is None:
            self.running = False
            return
        if self.sock is not None:
            self.selector.unregister(self.sock)
            self.sock.close()
            self.sock = None

    def send(self, message: dict[str, Any]) -> None:
        if self.sock is None:
            return  # no controller now: the next one lists what exited
        try:
            zygote_protocol.send(self.sock, message)
        except OSError:
            self.lost_client()

    def on_control(self) -> None:
        assert self.sock is not None
        try:
            message, fds = zygote_protocol.recv(self.sock)
        except (OSError, zygote_protocol.ProtocolError) as exc:
            log.error("zygote control channel failed: %s", exc)
            self.lost_client()
            return
        if message is None:
            self.lost_client()
            return
        op, rid = message.get("op"), message.get("id")
        try:
            if op == "shutdown":
                self.running = False
                self.send({"id": rid, "ok": True})
            elif op == "launch":
                owned, fds = fds, []  # launch() closes them, whatever happens
                self.launch(message, owned)
            elif op == "kill":
                self.kill(message, rid)
            elif op == "stats":
                own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
                self.send({"id": rid, "ok": True, "sandboxes": len(self.sandboxes),
                           "cpu_self_seconds": own.ru_utime + own.ru_stime,
                           "cpu_children_seconds": children.ru_utime + children.ru_stime,
                           "cpu_runner_templates_seconds": self.templates.cpu_seconds() if self.templates else 0.0,
                           "netns": self.netns.stats() if self.netns is not None else None})
            elif op == "list":
                self.send({"id": rid, "ok": True, "sandboxes": [
                    {"sandbox_id": s.sandbox_id, "pid": s.pid, "status": s.status}
                    for s in self.sandboxes.values()]})
            else:
                self.send({"id": rid, "ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the zygote down
            self.send({"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            for fd in fds:
                os.close(fd)

    # -- launch --------------------------------------------------------------------------
    def launch(self, message: dict[str, Any], fds: list[int]) -> None:
        rid = message.get("id")
        sandbox_id = message.get("sandbox_id")
        if len(fds) not in (1, 2):
            for fd in fds:
                os.close(fd)
            raise ValueError("launch needs the secret's descriptor and at most one more (the readiness pipe)")
        secret_fd, ready_fd = fds[0], fds[1] if len(fds) == 2 else None
        try:
            if not isinstance(sandbox_id, str) or not SANDBOX_ID.match(sandbox_id):
                raise ValueError("bad sandbox id")
            if sandbox_id in self.sandboxes:
                raise ValueError("sandbox id already in use")
            limits = message.get("limits") or {}
            agent = message.get("agent") or {}
            host_socket = message.get("socket_path")
            if not isinstance(limits, dict) or not isinstance(agent, dict) or not isinstance(host_socket, str):
                raise ValueError("malformed launch request")
            uid = message.get("uid")
            if uid is not None and (not isinstance(uid, int) or isinstance(uid, bool) or not 0 < uid < 2**31):
                raise ValueError("uid must be a positive integer")
            if "unprivileged_uid" not in self.layers:
                uid = None
            egress_socket = message.get("egress_socket")
            if egress_socket is not None and (not isinstance(egress_socket, str) or not os.path.isabs(egress_socket)):
                raise ValueError("egress_socket must be an absolute path")
            self._launch(rid, sandbox_id, uid, limits, agent, host_socket, message.get("workspace"),
                         message.get("log_path"), secret_fd, ready_fd, egress_socket=egress_socket)
        finally:
            os.close(secret_fd)
            if ready_fd is not None:
                os.close(ready_fd)  # the agent's alone now: end-of-file reaches the provider when it dies

    def _launch(self, rid: Any, sandbox_id: str, uid: int | None, limits: dict[str, Any], agent: dict[str, Any],
                host_socket: str, host_workspace: Any, log_path: Any, secret_fd: int, ready_fd: int | None, *,
                egress_socket: str | None = None) -> None:
        if not isinstance(host_workspace, str) or not os.path.isabs(host_workspace):
            raise ValueError("workspace must be an absolute path")
        memory_bytes, pids_max = _int(limits.get("memory_bytes")), _int(limits.get("pids_max"))
        code_pids_max, cpu_millis = _int(limits.get("code_pids_max")), _int(limits.get("cpu_millis"))
        workspace_bytes = _int(limits.get("workspace_bytes"))
        cgroup = None
        if self.cgroups is not None:
            cgroup = self.cgroups.create(sandbox_id, memory_bytes=memory_bytes, pids_max=pids_max,
                                         code_pids_max=code_pids_max, cpu_millis=cpu_millis)
        fs = None
        if "filesystem" in self.layers:
            if not os.path.isdir(self.new_root):  # swept: the template's mounts went with it
                os.makedirs(self.new_root, mode=0o700, exist_ok=True)
                self._prepare_root_template()
            fs = mounts.SandboxFs(
                uid=uid if uid is not None else 0, gid=uid if uid is not None else 0,
                # The provider's workspace when it is already a (capped) mount or no cap was asked
                # for; otherwise a tmpfs of the asked size inside the sandbox's namespace.
                workspace_source=host_workspace if os.path.ismount(host_workspace) or not workspace_bytes
                else None,
                workspace_bytes=workspace_bytes or 256 * MIB,
                tmp_bytes=min(workspace_bytes or 64 * MIB, 64 * MIB), shm_bytes=min(memory_bytes or 64 * MIB, 64 * MIB),
                agent_dir=os.path.dirname(host_socket), egress_socket=egress_socket)
        status_r, status_w = os.pipe()
        python = agent.get("python_executable") or sys.executable
        channel = self.templates.channel(python) if self.templates is not None and uid is not None else None
        template_fd = channel[0].detach() if channel is not None else None
        spec = zygote_child.ChildSpec(
            sandbox_id=sandbox_id, layers=self.layers, uid=uid, plan=self.plan, fs=fs, new_root=self.new_root,
            host_workspace=host_workspace, host_socket=host_socket, agent=agent,
            log_path=log_path if isinstance(log_path, str) and os.path.isabs(log_path) else None,
            network_ready=self.netns is not None, template_fd=template_fd, ready_fd=ready_fd,
            root_template=self.root_template)
        netns = None
        try:
            # The child is forked inside its network namespace (as it is inside its PID namespace):
            # one of the pool's, used by no live sandbox, pristine (isolation/netns.py).
            netns = self.netns.take() if self.netns is not None else None
            pid = self._fork_into(netns)
        except BaseException:
            os.close(status_r)
            os.close(status_w)
            if channel is not None and template_fd is not None:
                os.close(template_fd)
                channel[1].close()
            if netns is not None and self.netns is not None:
                self.netns.give_back(netns)  # no process ever ran in it: judged, and kept if untouched
            if cgroup is not None:
                cgroup.remove(0.5)
            raise
        if pid == 0:  # pragma: no cover - the sandbox; never returns
            try:
                if channel is not None:
                    channel[1].close()  # the template's end: held here, the agent would never see it close
                self._forget_in_child(keep=tuple(fd for fd in (status_w, secret_fd, template_fd, ready_fd,
                                                               self.root_template) if fd is not None))
                zygote_child.run(spec, cgroup, secret_fd, status_w)
            finally:
                os._exit(zygote_child.FAILED)
        os.close(status_w)
        sandbox = Sandbox(sandbox_id, pid, uid, cgroup, time.monotonic(), status_r, netns, rid)
        self.sandboxes[sandbox_id] = sandbox
        self.by_pid[pid] = sandbox
        self.selector.register(status_r, selectors.EVENT_READ, sandbox)
        if channel is not None and template_fd is not None and self.templates is not None:
            os.close(template_fd)
            self.templates.attach(python, channel[1], pid, cgroup.agent_procs_files() if cgroup is not None else [])

    def _fork_into(self, netns: NetNamespace | None) -> int:
        """Fork with the child in `netns` (when given); the zygote itself is back in its own after."""
        if netns is None or self.netns is None:
            return self._fork()
        self.netns.enter(netns)
        try:
            pid = self._fork()
        except BaseException:
            self.netns.leave()
            raise
        if pid != 0:
            self.netns.leave()
        return pid

    def _fork(self) -> int:
        if self.host_pidns is None:
            return os.fork()
        linux.unshare(linux.CLONE_NEWPID)
        try:
            return os.fork()
        finally:
            if os.getpid() != 1:  # in the parent: children we fork later get fresh namespaces too
                linux.setns(self.host_pidns, linux.CLONE_NEWPID)

    def _forget_in_child(self, keep: tuple[int, ...]) -> None:
        """In the forked child: drop every descriptor of the zygote's (not the kept ones)."""
        self.selector.close()
        for owned in (self.sock, self.listener):
            if owned is not None:
                owned.close()
        for fd in (self.wake_r, self.wake_w, self.host_pidns, self.owner_fd, self.root_template,
                   *(self.netns.fds() if self.netns else ()),
                   *(self.templates.fds() if self.templates else ())):
            if fd is not None and fd not in keep:
                os.close(fd)
        for other in self.sandboxes.values():
            if other.status_fd is not None and other.status_fd not in keep:
                os.close(other.status_fd)

    def on_status(self, sandbox: Sandbox) -> None:
        fd = sandbox.status_fd
        assert fd is not None
        try:
            data = os.read(fd, 1024)
        except OSError:
            data = b""
        self.selector.unregister(fd)
        os.close(fd)
        sandbox.status_fd = None
        rid, sandbox.launch_request = sandbox.launch_request, None
        if data == b"ok":
            sandbox.status = "running"
            self.send({"id": rid, "ok": True, "pid": sandbox.pid, "sandbox_id": sandbox.sandbox_id,
                       "uid": sandbox.uid})
            return
        reason = data.decode(errors="replace").removeprefix("error: ") or "the sandbox exited during set-up"
        sandbox.status = "failed"
        self._signal(sandbox)
        self.send({"id": rid, "ok": False, "error": reason})

    # -- kill and reap -------------------------------------------------------------------
    def recheck_netns(self) -> None:
        """Twice a second, look again at returned namespaces still waiting for a socket to be freed."""
        if self.netns is None or not self.netns.quarantine:
            return
        now = time.monotonic()
        if now - self.netns_checked >= 0.5:
            self.netns_checked = now
            self.netns.recheck()

    def _signal(self, sandbox: Sandbox) -> None:
        try:
            os.kill(sandbox.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self, message: dict[str, Any], rid: Any) -> None:
        pid = message.get("pid")
        if isinstance(pid, int) and not isinstance(pid, bool):
            sandbox = self.by_pid.get(pid)
        else:
            sandbox = self.sandboxes.get(str(message.get("sandbox_id")))
        if sandbox is None:
            self.send({"id": rid, "ok": True, "gone": True})
            return
        sandbox.kill_requests.append(rid)
        self._signal(sandbox)

    def reap(self) -> None:
        while self.by_pid:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sandbox = self.by_pid.pop(pid, None)
            if sandbox is not None:
                self._finish(sandbox, status)
            elif self.templates is not None:
                self.templates.reaped(pid, status)

    def _finish(self, sandbox: Sandbox, status: int) -> None:
        self.sandboxes.pop(sandbox.sandbox_id, None)
        if sandbox.netns is not None and self.netns is not None:
            # Its PID-namespace init is reaped: the kernel has killed and released every process
            # of the sandbox, so nothing of it can act in the namespace any more.
            self.netns.give_back(sandbox.netns)
            sandbox.netns = None
        if sandbox.status_fd is not None:
            self.selector.unregister(sandbox.status_fd)
            os.close(sandbox.status_fd)
            sandbox.status_fd = None
        started = time.monotonic()
        cleaned = sandbox.cgroup.remove() if sandbox.cgroup is not None else True
        spent = time.monotonic() - started
        if spent > 0.05:
            log.warning("removing a sandbox's cgroups took %.0f ms", spent * 1000,
                        extra={"sandbox_id": sandbox.sandbox_id})
        code = os.waitstatus_to_exitcode(status)
        if sandbox.launch_request is not None:
            self.send({"id": sandbox.launch_request, "ok": False,
                       "error": f"the sandbox exited during set-up (status {code})"})
        # The kernel vouches that nothing the sandbox started survives when its PID namespace's
        # init has been reaped (the namespace's other processes are killed and reaped before
        # init's own exit completes) or when its cgroup was removed (rmdir fails while one task is
        # left): then nobody needs to scan /proc for stragglers.
        contained = self.host_pidns is not None or (sandbox.cgroup is not None and cleaned)
        for rid in sandbox.kill_requests:
            self.send({"id": rid, "ok": True, "cleaned": cleaned, "contained": contained})
        if not sandbox.kill_requests and sandbox.launch_request is None and sandbox.status != "failed":
            self.send({"event": "exit", "sandbox_id": sandbox.sandbox_id, "status": code, "cleaned": cleaned})

    def shutdown(self) -> None:
        for sandbox in list(self.sandboxes.values()):
            self._signal(sandbox)
        deadline = time.monotonic() + 5
        while self.by_pid and time.monotonic() < deadline:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            reaped = self.by_pid.pop(pid, None)
            if reaped is not None and reaped.cgroup is not None:
                reaped.cgroup.remove()
        if self.templates is not None:
            self.templates.close()
        if self.cgroups is not None:
            self.cgroups.close()
        if self.netns is not None:
            self.netns.close()
        if self.root_template is not None:
            os.close(self.root_template)  # the template namespace, and its mounts, go with it
            self.root_template = None
        # Our mount-point directory, and the run directory if that leaves it empty (a client
        # dropped without closing it still leaves nothing behind once we see end-of-stream).
        for path in (self.new_root, self.config.run_dir):
            try:
                os.rmdir(path)
            except OSError:
                break


def _warm_agent() -> None:
    """Build (and call once) a throwaway agent app, so that every lazy import and cache the
    first app and the first request would fill (FastAPI imports pydantic.v1 on the first
    route, ~20 ms) is filled here, once, instead of in every sandbox. The dummy secret
    guards nothing: this app never listens."""
    import asyncio
    import codecs
    import tempfile
    from pathlib import Path

    import uvicorn

    from sandpool.agent import seccomp
    from sandpool.agent.app import create_app, routes_app
    from sandpool.agent.settings import AgentSettings
    from sandpool.contract.models import CODE_EXECUTION, parse_exec_request

    parse_exec_request({"tool": CODE_EXECUTION, "input": {"code": "pass"}})  # builds the kinds' parser, once
    # The agent reads /proc files as ASCII (agent/hardening.py): the codec's module is imported, and the
    # codec cached, on its first lookup; here, not in every sandbox (~0.5 ms of each agent's start).
    codecs.lookup("ascii")
    # The agent's temporary directories (agent/hardening.py: matplotlib_dir): the first call probes the
    # candidates by writing files in them. The zygote runs with a scrubbed environment, so this is
    # /tmp, which every sandbox root has (its own tmpfs).
    tempfile.gettempdir()
    arch = seccomp.native_arch()
    if arch is not None:
        seccomp.build_program(arch)  # built once here, installed by every sandbox

    dummy = "warm-up-only-" + "0" * 32
    app = create_app(AgentSettings(agent_secret=dummy, workspace=Path("/")), dummy, workspace="/")
    uvicorn.Config(app, uds="/nonexistent/warm.sock", log_config=None, access_log=False, lifespan="on",
                   proxy_headers=False).load()

    async def call() -> None:
        sent: list[MutableMapping[str, Any]] = []
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
                 "scheme": "http", "path": "/healthz", "raw_path": b"/healthz", "query_string": b"",
                 "root_path": "", "headers": [(b"host", b"sandbox")], "client": None, "server": None}
        done = False

        async def receive() -> dict[str, Any]:
            nonlocal done
            if done:
                await asyncio.sleep(3600)
            done = True
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)  # the agent's own path
        done = False
        await routes_app()(scope, receive, send)  # FastAPI's: builds its middleware stack, once

    asyncio.run(call())


def _int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError("limits must be integers") from None
    if number <= 0:
        raise ValueError("limits must be positive")
    return number


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="sandpool zygote (started by the local provider)")
    parser.add_argument("--fd", type=int, required=True, help="inherited SOCK_SEQPACKET control socket")
    parser.add_argument("--parent", type=int, required=True, help="pid that must be our parent")
    parser.add_argument("--listen", default=None, help="outlive the parent: wait here for the next controller")
    parser.add_argument("--end-with-pid", type=int, default=None, help="end everything when this process ends")
    args = parser.parse_args(argv)
    if args.listen is None:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
    # Runners a dead runner template forked come here, not to the host's init: reaped (`reap`).
    linux.prctl(linux.PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != args.parent:  # the parent died before PDEATHSIG was armed
        sys.exit(1)
    # `python -m` put the working directory first on sys.path: nothing is imported from there.
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p not in ("", cwd)]
    configure_logging("zygote")
    sock = socket.socket(fileno=args.fd)
    # The configuration arrives as the first message, not in argv: every sandbox's PID 1
    # inherits this process's command line, and `ps` in a sandbox shows it.
    first, fds = zygote_protocol.recv(sock)
    for fd in fds:
        os.close(fd)
    if first is None or first.get("op") != "configure":
        sys.exit(1)
    listener = None
    if args.listen is not None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(args.listen)  # a dead zygote's: the client found nobody listening there
        old = os.umask(0o177)
        try:
            listener.bind(args.listen)
        finally:
            os.umask(old)
        listener.listen(4)
        listener.setblocking(False)
        os.set_inheritable(listener.fileno(), False)
    zygote = Zygote(sock, ZygoteConfig.from_dict(first), listener)
    if args.end_with_pid is not None:
        try:
            zygote.watch_end_of(os.pidfd_open(args.end_with_pid))
        except OSError:  # already gone
            sys.exit(0)
    zygote.prepare()
    try:
        zygote.serve()
    finally:
        if args.listen is not None:
            with contextlib.suppress(OSError):
                os.unlink(args.listen)


if __name__ == "__main__":
    main()
