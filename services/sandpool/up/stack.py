"""The processes of one `sandpool up`: Redis, the egress proxy, the controller, the api; started in order,
stopped in reverse.

Each child runs in its own process group, dies with `up` (PDEATHSIG) and writes
the one-line reason of a failed start to a file in `<data-dir>/run/`, which `up`
repeats as its own last word. Once the stack is up, a controller, api or egress
proxy that dies is started again with backoff, saying so on stderr (a session
outlives either); a Redis that dies stops the stack. SIGTERM or Ctrl-C stops
everything it started (SIGTERM, then SIGKILL after a grace period), destroys
every sandbox and forgets their Redis records.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sandpool.core.settings import ConfigurationError, environ
from sandpool.up.preflight import free_port, redis_server_binary
from sandpool.up.settings import UpSettings

log = logging.getLogger("sandpool.up")


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class Stack:
    """The processes of one `sandpool up`, started in order and stopped in reverse."""

    def __init__(self, settings: UpSettings, *, api_flags: list[str] | None = None,
                 controller_flags: list[str] | None = None, pools: list[str] | None = None) -> None:
        self.settings = settings
        self.api_flags = list(api_flags or [])
        self.controller_flags = list(controller_flags or [])
        self.pools = list(pools or ["default"])  # the first is the default pool, the one `up` waits for
        self.data_dir = Path(settings.data_dir).expanduser().absolute()
        self.run_dir = self.data_dir / "run"
        self.children: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.argv: dict[str, tuple[list[str], str | None]] = {}  # child -> how to start it again
        self.redis_url = settings.redis_url
        self.prefix = settings.redis_prefix
        self.sockets: Path | None = None  # Redis's, the controller's and egress's Unix sockets: short, private
        self._stopped = False
        self._lock_fd: int | None = None
        self.egress_socket: Path | None = None

    # --- start -----------------------------------------------------------------------
    def run(self, stopping: threading.Event) -> int:
        s = self.settings
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o711)  # sandboxed uids traverse it to reach their workspace, never list it
        if self._lock_fd is None:
            self.lock_data_dir()
        self.run_dir.mkdir(mode=0o700, exist_ok=True)
        for stale in self.run_dir.glob("*.failed"):
            stale.unlink()
        _remove_recorded_runtime_dir(self.run_dir / SOCKETS_RECORD)
        self.sockets = _runtime_dir()
        _write_private(self.run_dir / SOCKETS_RECORD, str(self.sockets))
        if self.redis_url is None:
            self.redis_url = self._start_redis(stopping)
        egress_flags: list[str] = []
        if s.egress_allow_ceiling:
            self.egress_socket = self._start_egress(stopping)
            egress_flags = ["--egress-socket", str(self.egress_socket)]
        auth = s.auth
        # The controller's probes and /metrics on a Unix socket only up's user reaches; the api is public.
        controller_socket = self.sockets / "controller.sock"
        self._spawn("controller", [
            "controller", "--unix-socket", str(controller_socket),
            "--data-dir", str(self.data_dir), "--pool-size", str(s.pool_size),
            "--max-sandboxes", str(s.max_sandboxes), "--log-level", s.log_level,
            # A controller that dies ends no session (the next adopts its sandboxes); a killed up leaves none.
            "--sandboxes-outlive-controller", "--sandboxes-end-with-pid", str(os.getpid()),
            "--start-failure-file", str(self._failure_file("controller")), *self.controller_flags, *egress_flags,
        ])
        public_url = f"http://{_url_host(s.host)}:{s.port}"
        token = None
        mode = ["--no-auth"]
        if auth:
            public_key, token = self._auth_material()
            mode = ["--auth-public-key", str(public_key)]
        self._spawn("api", [
            "api", "--host", s.host, "--port", str(s.port), *mode,
            "--pool-size", str(s.pool_size), "--max-sandboxes", str(s.max_sandboxes),
            "--log-level", s.log_level, "--start-failure-file", str(self._failure_file("api")), *self.api_flags,
        ])
        if not self._wait_warm(f"unix://{controller_socket}", public_url, stopping):
            if stopping.is_set():
                return 0
            raise ConfigurationError(self._why_not_started())
        print(f"SANDPOOL_URL={public_url}", flush=True)
        if token is not None:
            print(f"SANDPOOL_TOKEN={token}", flush=True)
        if not auth or token is not None:
            print(curl_line(public_url, token), flush=True)
        if auth and token is None:
            log.info("auth on with your key: mint tokens with `sandpool token --key <private key> --workspace W`")
        log.info("sandpool is up", extra={"url": public_url, "auth": auth})
        return self._supervise(stopping)

    def _supervise(self, stopping: threading.Event) -> int:
        """Start again a child that dies (Redis excepted), with backoff; 1 once Redis is gone."""
        backoff: dict[str, float] = {}
        started_at: dict[str, float] = {}
        while not stopping.wait(0.25):
            for index, (name, proc) in enumerate(self.children):
                if proc.poll() is None:
                    continue
                reason = self._exit_reason(name, proc)
                if name not in self.argv:
                    log.error("a process of the stack exited; stopping everything",
                              extra={"child": name, "returncode": proc.returncode})
                    print(f"sandpool up: the {name} exited ({reason}); everything it started is stopped",
                          file=sys.stderr, flush=True)
                    return 1
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # whatever it left behind in its group
                self._failure_file(name).unlink(missing_ok=True)
                if time.monotonic() - started_at.get(name, -math.inf) > RESTART_RESET_SECONDS:
                    backoff[name] = 0.0  # it stayed up a while: its backoff starts anew
                pause = min(RESTART_MAX_SECONDS, max(RESTART_MIN_SECONDS, 2 * backoff.get(name, 0.0)))
                print(f"sandpool up: the {name} exited ({reason}); starting it again in {pause:g}s",
                      file=sys.stderr, flush=True)
                log.warning("restarting a process of the stack", extra={"child": name, "in_seconds": pause})
                if stopping.wait(pause):
                    return 0
                argv, program = self.argv[name]
                self.children[index] = (name, self._popen(argv, program))
                backoff[name], started_at[name] = pause, time.monotonic()
        return 0

    def _failure_file(self, child: str) -> Path:
        return self.run_dir / f"{child}.failed"

    def _exit_reason(self, name: str, proc: subprocess.Popen[bytes]) -> str:
        try:
            reason = self._failure_file(name).read_text().strip()
        except OSError:
            reason = ""
        if reason:
            return reason
        code = proc.returncode
        return f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"status {code}"

    def _why_not_started(self) -> str:
        """The one line saying which process kept the stack from starting, and why."""
        for name, proc in self.children:
            if proc.poll() is not None:
                return f"the {name} could not start: {self._exit_reason(name, proc)}"
        return (f"the pool did not become warm within {self.settings.ready_timeout_seconds:g}s "
                "(see the log above; raise --ready-timeout-seconds on a slow host)")

    def _start_redis(self, stopping: threading.Event) -> str:
        redis_dir = self.data_dir / "redis"
        redis_dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(redis_dir, 0o700)
        port = self.settings.redis_port or free_port()
        password = secrets.token_urlsafe(24)
        conf = redis_dir / "redis.conf"
        # The password lives in a 0600 file (never argv); sandboxes hold neither it nor the port's purpose.
        assert self.sockets is not None
        redis_socket = self.sockets / "redis.sock"
        _write_private(conf, "\n".join([
            "bind 127.0.0.1", f"port {port}", f"unixsocket {redis_socket}", "unixsocketperm 600",
            "protected-mode yes", f"requirepass {password}",
            f"dir {redis_dir}", "appendonly yes", "appendfsync everysec", 'save ""', "daemonize no",
            "loglevel warning", 'logfile ""', ""]))
        self._spawn("redis", [str(conf)], program=redis_server_binary())
        url = f"unix://:{password}@{redis_socket}?db=0"  # the services' way in; the port is for redis-cli
        from sandpool.state import StateUnavailable
        from sandpool.state.client import ping_sync

        deadline = time.monotonic() + 20
        while True:
            try:
                ping_sync(url, timeout=1)
                return url
            except StateUnavailable:
                pass
            if stopping.is_set() or time.monotonic() > deadline or self._exited("redis"):
                raise ConfigurationError(f"redis could not start: redis-server on port {port} did not "
                                         "answer (its log is above; is the port free?)")
            time.sleep(0.05)

    def _start_egress(self, stopping: threading.Event) -> Path:
        """The egress proxy on a Unix socket in the stack's socket directory (the sandboxes' only way out;
        its TCP port, on loopback, is of no use to a sandbox, which has a network of its own); returns
        once the socket accepts connections."""
        assert self.sockets is not None
        socket_path = self.sockets / "egress.sock"
        s = self.settings
        self._spawn("egress", [
            "egress", "--host", "127.0.0.1", "--port", "0", "--unix-socket", str(socket_path),
            "--egress-allow-ceiling", ",".join(s.egress_allow_ceiling), "--log-level", s.log_level,
            "--start-failure-file", str(self._failure_file("egress")),
        ])
        deadline = time.monotonic() + 20
        while not _listening(socket_path):
            if self._exited("egress"):
                raise ConfigurationError(self._why_not_started())
            if stopping.is_set() or time.monotonic() > deadline:
                raise ConfigurationError(f"the egress proxy did not listen on {socket_path} within 20s")
            time.sleep(0.05)
        log.info("egress proxy up", extra={"socket": str(socket_path), "ceiling": s.egress_allow_ceiling})
        return socket_path

    def _auth_material(self) -> tuple[Path, str | None]:
        if self.settings.auth_public_key is not None:
            return Path(self.settings.auth_public_key).expanduser().absolute(), None
        from sandpool.edge.keys_cli import generate_keypair, mint_token, public_key_path

        auth_dir = self.data_dir / "auth"
        auth_dir.mkdir(mode=0o700, exist_ok=True)
        private = auth_dir / "dev-key.pem"
        if not private.exists():
            generate_keypair(private)
        token = mint_token(private, self.settings.token_workspace, ttl_seconds=self.settings.token_ttl_seconds)
        return public_key_path(private), token

    def _spawn(self, name: str, argv: list[str], *, program: str | None = None) -> None:
        proc = self._popen(argv, program)
        self.children.append((name, proc))
        if program is None:  # sandpool's own services are started again should they die
            self.argv[name] = (argv, program)
        log.info("started", extra={"child": name, "pid": proc.pid})

    def _popen(self, argv: list[str], program: str | None) -> subprocess.Popen[bytes]:
        command = [program] if program else [sys.executable, "-m", "sandpool"]
        env = environ()
        if self.redis_url:
            env["SANDPOOL_REDIS_URL"] = self.redis_url  # by environment: argv is world-readable
        env["SANDPOOL_REDIS_PREFIX"] = self.prefix
        return subprocess.Popen(command + argv, env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr,
                                stderr=sys.stderr, start_new_session=True, preexec_fn=_die_with_parent())

    def _exited(self, name: str) -> bool:
        return any(n == name and p.poll() is not None for n, p in self.children)

    def _wait_warm(self, controller_url: str, api_url: str, stopping: threading.Event) -> bool:
        """Wait for /readyz (controller and api) and the pool's warm target, without leasing anything."""
        import httpx

        from sandpool.state import StateUnavailable
        from sandpool.state.client import ready_count_sync
        from sandpool.state.keys import Keys

        ready_key = Keys(prefix=self.prefix).pool_ready(self.pools[0])
        assert self.redis_url is not None
        deadline = time.monotonic() + self.settings.ready_timeout_seconds
        clients = [_http_client(controller_url), _http_client(api_url)]
        with contextlib.ExitStack() as closing:
            for client in clients:
                closing.enter_context(client)
            while not stopping.is_set():
                if any(proc.poll() is not None for _, proc in self.children):
                    return False
                try:
                    ready = all(client.get("/readyz").status_code == 200 for client in clients)
                    warm = ready and ready_count_sync(self.redis_url, ready_key) >= self.settings.pool_size
                except (httpx.HTTPError, StateUnavailable):
                    warm = False
                if warm:
                    return True
                if time.monotonic() > deadline:
                    return False
                stopping.wait(0.1)
        return False

    # --- stop ------------------------------------------------------------------------
    def unlock_data_dir(self) -> None:
        """Give the data dir up before anything started (a failed pre-flight check)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._stopped = True

    def lock_data_dir(self) -> None:
        """One `up` per data dir: a second one would take the first's Redis files and, on its
        way out, destroy the first's sandboxes. The lock goes with the process, however it ends."""
        fd = os.open(self.data_dir / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._stopped = True  # nothing here is ours to stop or clean up
            raise ConfigurationError(f"another sandpool up is using {self.data_dir}: "
                                     "stop it, or give this one another --data-dir") from None
        self._lock_fd = fd  # held open (never inherited: O_CLOEXEC is Python's default) until exit

    def stop(self) -> None:
        """Stop the children in reverse order, then destroy every sandbox. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        redis_child = [(n, p) for n, p in self.children if n == "redis"]
        for name, proc in reversed([(n, p) for n, p in self.children if n != "redis"]):
            self._terminate(name, proc)
        try:
            self._destroy_sandboxes()
        except Exception:  # never leave the children running because cleanup failed
            log.exception("sandbox cleanup failed")
        for name, proc in redis_child:
            self._terminate(name, proc)
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)
            (self.run_dir / SOCKETS_RECORD).unlink(missing_ok=True)

    def _terminate(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.settings.stop_grace_seconds)
            except subprocess.TimeoutExpired:
                log.warning("did not stop in time; killing", extra={"child": name})
        # The whole group: whatever the child left behind goes too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def _destroy_sandboxes(self) -> None:
        asyncio.run(destroy_all_sandboxes(self.data_dir, self.redis_url, self.prefix, self.pools))


async def destroy_all_sandboxes(data_dir: Path, redis_url: str | None, prefix: str, pools: list[str]) -> None:
    """Destroy every local sandbox, then let reconciliation forget their records (and release
    any session on them) so the next start leases nothing stale."""
    from sandpool.controller.controller import PoolController
    from sandpool.controller.provider import PoolSpec
    from sandpool.providers.local.provider import LocalProvider
    from sandpool.providers.local.settings import LocalProviderSettings
    from sandpool.state.keys import Keys

    provider = LocalProvider(LocalProviderSettings(data_dir=data_dir))
    count = await provider.destroy_all()
    log.info("sandboxes destroyed", extra={"count": count})
    if redis_url is None:
        return
    from sandpool.state import close, connect

    client = connect(redis_url, timeout=5)
    try:
        specs = [PoolSpec(name=name, image="", warm=0, ceiling=1) for name in pools]
        cleaner = PoolController(client, Keys(prefix=prefix), provider, specs, replica_id="sandpool-up-shutdown",
                                 start_timeout_seconds=0)
        await cleaner.reconcile()
    except Exception as exc:  # noqa: BLE001 - Redis gone already: the next start's reconciliation does it
        log.warning("could not forget sandbox records", extra={"error": str(exc)})
    finally:
        await close(client)


RESTART_MIN_SECONDS = 0.5
RESTART_MAX_SECONDS = 30.0
"""The backoff between restarts of a child that keeps dying (doubling from the least to the most)."""
RESTART_RESET_SECONDS = 60.0
"""A child that stayed up this long starts its backoff anew when it dies next."""

SOCKETS_RECORD = "sockets-dir"
"""The run dir's note of where this run's sockets are, so the next `up` on the data dir removes
them after a SIGKILL left no chance to (it holds the data dir's lock: their owner is gone)."""


def _remove_recorded_runtime_dir(record: Path) -> None:
    try:
        recorded = Path(record.read_text().strip())
    except OSError:
        return
    if recorded.name.startswith("sandpool-up-") and recorded.is_dir() and recorded.stat().st_uid == os.getuid():
        shutil.rmtree(recorded, ignore_errors=True)
    record.unlink(missing_ok=True)


def _runtime_dir() -> Path:
    """A new private (0700) directory with a short path for the stack's Unix sockets: the data dir
    may be too long for one (a socket path is at most 107 bytes)."""
    for base in dict.fromkeys([os.environ.get("XDG_RUNTIME_DIR") or "", tempfile.gettempdir(), "/tmp"]):
        if base and os.path.isdir(base) and len(base) <= 60:
            return Path(tempfile.mkdtemp(prefix="sandpool-up-", dir=base))
    raise ConfigurationError("no short temporary directory for the stack's sockets: set TMPDIR to one")


def _http_client(url: str) -> Any:
    import httpx

    if url.startswith("unix://"):
        return httpx.Client(transport=httpx.HTTPTransport(uds=url[len("unix://"):]), base_url="http://controller",
                            timeout=2.0)
    return httpx.Client(base_url=url, timeout=2.0)


def _die_with_parent() -> Any:
    """A pre-exec hook: the child gets SIGTERM if `sandpool up` itself is killed (SIGKILL leaves
    no chance to stop it), so nothing it started outlives it. Linux only; `up` spawns from
    its only thread, where a pre-exec hook is safe."""
    if not sys.platform.startswith("linux"):
        return None
    from sandpool.providers.local.isolation.linux import PR_SET_PDEATHSIG, libc, prctl

    libc()  # loaded here, not in the forked child
    parent = os.getpid()

    def hook() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # up died between fork and prctl
            os._exit(1)

    return hook


def _listening(path: Path) -> bool:
    import socket

    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def curl_line(url: str, token: str | None) -> str:
    """One shell line: create a session, run print(1) in it, and release it again."""
    auth = ["-H", f"Authorization: Bearer {token}"] if token else []
    json_h = ["-H", "Content-Type: application/json"]
    create = shlex.join(["curl", "-sf", "-X", "POST", f"{url}/sessions", *auth, *json_h, "-d", "{}"])
    extract = shlex.join(["python3", "-c", 'import json,sys; print(json.load(sys.stdin)["session_id"])'])
    body = '{"tool": "code_execution", "input": {"code": "print(1)"}}'
    session = shlex.quote(f"{url}/sessions/") + '"$SID"'
    execute = " ".join(["curl", "-s", "-X", "POST", session + "/exec", *map(shlex.quote, auth + json_h),
                        "-d", shlex.quote(body)])
    destroy = " ".join(["curl", "-s", "-o", "/dev/null", "-X", "DELETE", session, *map(shlex.quote, auth)])
    return f"SID=$({create} | {extract}) && {{ {execute}; echo; {destroy}; }}"
