"""Real processes for the resilience and security suites, each killable on its own.

Every service runs as `python -m sandpool <command>` in a process group of its own
(so `kill -9` of one replica leaves the others and the test runner alone), Redis is
a real `redis-server` the test owns (restartable on the same port and data), and
sandboxes are made by the scheduler's own pool controller and local provider under
a data dir in /tmp. Shared by tests/reliability, tests/security and tests/fuzz.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import redis
from testkit import (
    AgentProcess,
    free_port,
    keys_under,
    log_tail,
    redis_pong,
    redis_server_binary,
    scrubbed_env,
    wait_for,
    wait_http,
)

INTERNAL_TOKEN = "resilience-internal-credential-0123456789"
LONG = os.environ.get("SANDPOOL_LONG") == "1"  # the long versions (make test-long)

EXEC_BODIES: dict[str, dict[str, Any]] = {
    "code_execution": {"tool": "code_execution", "input": {"code": "print(6 * 7)"}},
    "bash_code_execution": {"tool": "bash_code_execution", "input": {"command": "echo hi"}},
    "text_editor_code_execution": {"tool": "text_editor_code_execution",
                                   "input": {"command": "create", "path": "notes.txt", "file_text": "x\n"}},
}


# --- Redis -------------------------------------------------------------------------------

class RedisProc:
    """A private `redis-server` on a fixed port, restartable with the same data (AOF on request)."""

    def __init__(self, root: Path, *, appendonly: bool = False, appendfsync: str = "everysec") -> None:
        self.dir = root / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "redis.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=5)

    def start(self) -> RedisProc:
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--protected-mode", "yes", "--logfile", str(self.log)]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        else:
            args += ["--appendonly", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

        def pong() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited: {log_tail(self.log, 2000)}")
            return redis_pong(self.port)

        wait_for(pong, timeout=15, interval=0.02, what="redis-server PONG")
        # Loading an AOF answers -LOADING to PING: wait for a real answer.
        wait_for(lambda: self._loaded(), timeout=15, interval=0.02, what="redis-server loaded")
        return self

    def _loaded(self) -> bool:
        try:
            with self.client() as c:
                return bool(c.ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        """Graceful: SIGTERM makes redis-server write its AOF/RDB before it exits."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: Redis accepts connections (the kernel does) but answers nothing: 'unreachable'."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


# --- sandpool services ---------------------------------------------------------------------

class Service:
    """`python -m sandpool <argv>` in a session of its own, logging to a file."""

    def __init__(self, name: str, argv: list[str], root: Path, *, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        self.name = name
        self.argv = argv
        self.root = root
        self.env = env or scrubbed_env()
        self.port = port or free_port()
        self.log = root / f"{name}-{uuid.uuid4().hex[:6]}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> Service:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "sandpool", *self.argv, "--port", str(self.port)],
                                         env=self.env, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                         cwd=str(self.root), start_new_session=True)
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3000) -> str:
        return log_tail(self.log, n)

    def wait_ready(self, path: str = "/readyz", timeout: float = 60) -> Service:
        wait_http(self.url + path, proc=self.proc, log=self.log, timeout=timeout, probe_timeout=2,
                  what=f"{self.name} {path}")
        return self

    def kill9(self) -> None:
        """SIGKILL the service process alone (its children see it die, as after a crash)."""
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout: float = 20) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_group()
        return self.proc.returncode

    def kill_group(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def make_data_dir(prefix: str = "spr") -> Path:
    root = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    root.chmod(0o711)  # the sandbox uids must be able to enter it (socket paths, workspaces)
    return root


class Stack:
    """Redis + scheduler replicas (+ proxy) on one data dir; every piece killable on its own.

    Built by `build_stack`; `close()` stops what is left, destroys every sandbox and
    removes the data dir.
    """

    def __init__(self, root: Path, redis_proc: RedisProc, prefix: str, *, tenancy: bool,
                 scheduler_args: list[str]) -> None:
        self.root = root
        self.redis = redis_proc
        self.prefix = prefix
        self.tenancy = tenancy
        self.scheduler_args = scheduler_args
        self.schedulers: list[Service] = []
        self.proxy: Service | None = None
        self.token_file = root / "internal-token"
        self.token_file.write_text(INTERNAL_TOKEN)
        self.token_file.chmod(0o600)
        self.keys_dir = root / "keys"
        self.private_key: Path | None = None
        self.public_key: Path | None = None

    # processes
    def add_scheduler(self, *extra: str, controller: bool = True, wait: bool = True) -> Service:
        mode = ["--no-standalone", "--internal-token-file", str(self.token_file)] if self.tenancy else ["--standalone"]
        argv = ["scheduler", "--host", "127.0.0.1", *mode, "--redis-url", self.redis.url,
                "--redis-prefix", self.prefix, "--data-dir", str(self.root), "--log-level", "warning",
                *(["--controller"] if controller else ["--no-controller"]), *self.scheduler_args, *extra]
        service = Service(f"scheduler{len(self.schedulers)}", argv, self.root).start()
        self.schedulers.append(service)
        if wait:
            service.wait_ready()
        return service

    def add_proxy(self, *extra: str, scheduler: Service | None = None, wait: bool = True) -> Service:
        from sandpool.edge.keys_cli import generate_keypair

        if self.private_key is None:
            self.private_key, self.public_key = generate_keypair(self.keys_dir / "signing.pem")
        target = scheduler or self.schedulers[0]
        argv = ["proxy", "--host", "127.0.0.1", "--scheduler-url", target.url, "--redis-url", self.redis.url,
                "--redis-prefix", self.prefix, "--auth-public-key", str(self.public_key),
                "--internal-token-file", str(self.token_file), "--log-level", "warning", *extra]
        port = self.proxy.port if self.proxy is not None else None
        self.proxy = Service("proxy", argv, self.root, port=port).start()
        if wait:
            self.proxy.wait_ready()
        return self.proxy

    def token(self, workspace: str = "acme", **kwargs: Any) -> str:
        from sandpool.edge.keys_cli import mint_token

        assert self.private_key is not None, "add_proxy() first"
        return mint_token(self.private_key, workspace, **kwargs)

    def client(self, workspace: str | None = None, *, via: Service | None = None, timeout: float = 30,
               **token_kwargs: Any) -> httpx.Client:
        """A client of the public edge: the proxy with a token, or the (standalone) scheduler."""
        if via is None and self.proxy is not None:
            via = self.proxy
        via = via or self.schedulers[0]
        headers = {}
        if via is self.proxy:
            headers["Authorization"] = f"Bearer {self.token(workspace or 'acme', **token_kwargs)}"
        return httpx.Client(base_url=via.url, headers=headers, timeout=timeout)

    # state
    def rdb(self) -> redis.Redis:
        return self.redis.client()

    def keys(self) -> list[str]:
        with self.rdb() as r:
            return keys_under(r, self.prefix)

    def sandbox_dirs(self) -> list[str]:
        base = self.root / "sandboxes"
        return sorted(p.name for p in base.iterdir()) if base.exists() else []

    def ready_count(self, pool: str = "default") -> int:
        from sandpool.state.keys import Keys

        with self.rdb() as r:
            return int(r.llen(Keys(self.prefix).pool_ready(pool)))

    def wait_warm(self, target: int, timeout: float = 60) -> None:
        wait_for(lambda: self.ready_count() >= target, timeout=timeout, what=f"{target} ready sandboxes")

    def close(self) -> None:
        services = ([self.proxy] if self.proxy else []) + self.schedulers
        for service in services:
            service.stop()
            service.kill_group()
        self.redis.stop()
        destroy_leftovers(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def destroy_leftovers(root: Path) -> None:
    """Whatever a killed scheduler left: sandboxes (and their mounts) under `root`."""
    if not (root / "sandboxes").exists():
        return
    import asyncio

    from sandpool.providers.local.provider import LocalProvider
    from sandpool.providers.local.settings import LocalProviderSettings

    async def run() -> None:
        provider = LocalProvider(LocalProviderSettings(data_dir=root, launcher="subprocess"))
        try:
            await provider.destroy_all()
        finally:
            close = getattr(provider, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result

    try:
        asyncio.run(run())
    except Exception:  # noqa: BLE001 - best effort at teardown; the test already has its verdict
        pass


def build_stack(*, tenancy: bool = False, proxy: bool = False, replicas: int = 1, pool_size: int = 2,
                max_sandboxes: int = 6, appendonly: bool = False, appendfsync: str = "everysec",
                scheduler_args: Iterable[str] = (), proxy_args: Iterable[str] = ()) -> Stack:
    root = make_data_dir()
    redis_proc = RedisProc(root, appendonly=appendonly, appendfsync=appendfsync).start()
    stack = Stack(root, redis_proc, "r" + secrets.token_hex(5), tenancy=tenancy or proxy,
                  scheduler_args=["--pool-size", str(pool_size), "--max-sandboxes", str(max_sandboxes),
                                  "--reap-interval-seconds", "0.2", *scheduler_args])
    try:
        for _ in range(replicas):
            stack.add_scheduler()
        if proxy:
            stack.add_proxy(*proxy_args)
        stack.wait_warm(pool_size)
    except BaseException:
        for service in stack.schedulers:
            service.log_tail()
        stack.close()
        raise
    return stack


# --- a standalone agent --------------------------------------------------------------------

class AgentProc(AgentProcess):
    """One real `sandpool agent` on a Unix socket, with a canary directory beside its workspace and a
    client that presents its secret."""

    def __init__(self, *args: str) -> None:
        self.root = make_data_dir("spf")
        self.canary = self.root / "canary"
        self.canary.mkdir()
        (self.canary / "secret.txt").write_text("canary\n")
        super().__init__(self.root / "workspace", self.root / "agent.log", *args,
                         socket_path=self.root / "agent.sock")
        self.start()
        self.client = self.new_client(self.secret, timeout=30)
        self.wait_healthy(timeout=30)

    def close(self) -> None:
        self.client.close()
        self.stop(15)
        shutil.rmtree(self.root, ignore_errors=True)
