"""Real processes for the resilience and security suites, each killable on its own.

Every service runs as `python -m sandpool <command>` in a process group of its own
(so `kill -9` of one replica leaves the others and the test runner alone), Redis is
a real `redis-server` the test owns (restartable on the same port and data), and
sandboxes are made by `sandpool controller` (pool controller, local provider) under
a data dir in /tmp and served through `sandpool api`. Shared by tests/reliability,
tests/security and tests/fuzz.
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
    """Redis + controller replicas + api replicas on one data dir; every piece killable on its own.

    The controllers keep the pool warm (local provider, sandboxes under `root/sandboxes`) and
    reap sessions; one leads. The apis are the request path: with `auth`, each trusts the
    stack's own signing key (`token()` mints for it); without, each serves the one standalone
    caller (`--no-auth`, workspace `_standalone`). Built by `build_stack`; `close()` stops
    what is left, destroys every sandbox and removes the data dir.
    """

    def __init__(self, root: Path, redis_proc: RedisProc, prefix: str, *, auth: bool,
                 api_args: list[str], controller_args: list[str]) -> None:
        self.root = root
        self.redis = redis_proc
        self.prefix = prefix
        self.auth = auth
        self.api_args = api_args
        self.controller_args = controller_args
        self.controllers: list[Service] = []
        self.apis: list[Service] = []
        self.keys_dir = root / "keys"
        self.private_key: Path | None = None
        self.public_key: Path | None = None
        if auth:
            from sandpool.edge.keys_cli import generate_keypair

            self.private_key, self.public_key = generate_keypair(self.keys_dir / "signing.pem")

    @property
    def api(self) -> Service:
        """The first api (the one a test talks to unless it picks another)."""
        return self.apis[0]

    # processes
    def _common(self) -> list[str]:
        return ["--host", "127.0.0.1", "--redis-url", self.redis.url, "--redis-prefix", self.prefix,
                "--log-level", "warning"]

    def add_controller(self, *extra: str, wait: bool = True, port: int | None = None) -> Service:
        """Another `sandpool controller` replica (it leads if no other does)."""
        argv = ["controller", *self._common(), "--data-dir", str(self.root), *self.controller_args, *extra]
        service = Service(f"controller{len(self.controllers)}", argv, self.root, port=port).start()
        self.controllers.append(service)
        if wait:
            service.wait_ready()
        return service

    def add_api(self, *extra: str, wait: bool = True, port: int | None = None) -> Service:
        """Another `sandpool api` replica: with the stack's key (auth) or `--no-auth`."""
        mode = ["--auth-public-key", str(self.public_key)] if self.auth else ["--no-auth"]
        argv = ["api", *self._common(), *mode, *self.api_args, *extra]
        service = Service(f"api{len(self.apis)}", argv, self.root, port=port).start()
        self.apis.append(service)
        if wait:
            service.wait_ready()
        return service

    def replace(self, service: Service, *, wait: bool = True) -> Service:
        """A new process of the same command on the same port, in place of `service` (killed or stopped)."""
        service.stop()
        fresh = Service(service.name, service.argv, self.root, env=service.env, port=service.port).start()
        for group in (self.controllers, self.apis):
            if service in group:
                group[group.index(service)] = fresh
        if wait:
            fresh.wait_ready()
        return fresh

    def token(self, workspace: str = "acme", **kwargs: Any) -> str:
        from sandpool.edge.keys_cli import mint_token

        assert self.private_key is not None, "build_stack(auth=True) mints tokens"
        return mint_token(self.private_key, workspace, **kwargs)

    def client(self, workspace: str | None = None, *, via: Service | None = None, timeout: float = 30,
               **token_kwargs: Any) -> httpx.Client:
        """A client of an api (the first unless `via`): with a token for `workspace` (default acme)
        when the stack has auth, bare when it serves the standalone caller."""
        via = via or self.api
        headers = {}
        if self.auth:
            headers["Authorization"] = f"Bearer {self.token(workspace or 'acme', **token_kwargs)}"
        return httpx.Client(base_url=via.url, headers=headers, timeout=timeout)

    def services(self) -> list[Service]:
        return [*self.apis, *self.controllers]

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
        for service in self.services():  # the apis first: nothing new is leased while the pools go
            service.stop()
            service.kill_group()
        self.redis.stop()
        destroy_leftovers(self.root)
        shutil.rmtree(self.root, ignore_errors=True)


def destroy_leftovers(root: Path) -> None:
    """Whatever a killed controller left: sandboxes (and their mounts) under `root`."""
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


def build_stack(*, auth: bool = False, replicas: int = 1, apis: int = 1, pool_size: int = 2,
                max_sandboxes: int = 6, appendonly: bool = False, appendfsync: str = "everysec",
                api_args: Iterable[str] = (), controller_args: Iterable[str] = ()) -> Stack:
    """Redis, `replicas` controllers and `apis` apis, and the pool warm. `auth`: the apis verify
    tokens signed by the stack's key (multi-tenant), else they serve one trusted client.
    `api_args` / `controller_args`: further flags of each (session settings are the api's;
    the provider's, the reaper's and `--data-dir` the controller's; pool sizes go to both)."""
    root = make_data_dir()
    redis_proc = RedisProc(root, appendonly=appendonly, appendfsync=appendfsync).start()
    pools = ["--pool-size", str(pool_size), "--max-sandboxes", str(max_sandboxes)]
    stack = Stack(root, redis_proc, "r" + secrets.token_hex(5), auth=auth,
                  api_args=[*pools, *api_args],
                  controller_args=[*pools, "--reap-interval-seconds", "0.2", *controller_args])
    try:
        for _ in range(replicas):
            stack.add_controller()
        for _ in range(apis):
            stack.add_api()
        stack.wait_warm(pool_size)
    except BaseException:
        for service in stack.services():
            print(f"--- {service.name}\n{service.log_tail()}")
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
