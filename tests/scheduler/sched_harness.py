"""Real parts for the scheduler tests: agents on Unix sockets, sandboxes published per the
lifecycle in docs/architecture.md, and the app served by uvicorn on loopback."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import uvicorn

from sandpool.contract import limits as catalogue
from sandpool.contract import tenancy
from sandpool.state import scripts
from sandpool.state.keys import Keys

INTERNAL_TOKEN = "test-internal-credential-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], *, timeout: float = 10.0, interval: float = 0.02, what: str = "") -> Any:
    """Poll until `predicate()` is truthy; fail with `what` at the deadline (never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(interval)


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    socket_path: Path
    workspace: Path
    secret: str
    log_path: Path

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
        if not self.socket_path.exists():
            return False
        try:
            transport = httpx.HTTPTransport(uds=str(self.socket_path))
            with httpx.Client(transport=transport, base_url="http://agent", timeout=1.0) as c:
                return c.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


class Agents:
    """Starts real `sandpool agent` processes on Unix sockets (short paths: sun_path is 108 bytes)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="spa", dir="/tmp"))
        self.started: list[Agent] = []

    def start(self, count: int = 1) -> list[Agent]:
        fresh = []
        for _ in range(count):
            name = uuid.uuid4().hex[:8]
            workspace = self.root / f"ws-{name}"
            workspace.mkdir()
            sock = self.root / f"{name}.sock"
            secret = secrets.token_urlsafe(24)
            log_path = self.root / f"{name}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "sandpool", "agent", "--uds", str(sock), "--workspace", str(workspace)],
                    env={**os.environ, "SANDPOOL_AGENT_SECRET": secret}, stdout=log, stderr=log,
                    start_new_session=True,
                )
            agent = Agent(proc, sock, workspace, secret, log_path)
            self.started.append(agent)
            fresh.append(agent)
        for agent in fresh:
            wait_for(agent.healthy, timeout=30, interval=0.05, what="agent health")
        return fresh

    def stop(self) -> None:
        for agent in self.started:
            agent.kill()
        shutil.rmtree(self.root, ignore_errors=True)


def publish(r: redis.Redis, keys: Keys, *, pool: str = "default", image: str = "python",
            address: str = "unix:///nonexistent.sock", secret: str = "unused") -> str:
    """Publish one ready sandbox exactly as the controller does: registered `starting`, then published
    by the controller's own script (which promises it to the next waiter, if any)."""
    sandbox_id = "sb-" + uuid.uuid4().hex[:12]
    now = time.time()
    assert r.eval(scripts.REGISTER_STARTING, 2, keys.sandbox(sandbox_id), keys.pool_members(pool),
                  sandbox_id, 1 << 30, pool, image, f"{now:.3f}", "tests", 3_600_000) == 1
    assert r.eval(scripts.PUBLISH_READY, 5, keys.sandbox(sandbox_id), keys.pool_ready(pool), keys.pool_members(pool),
                  keys.pool_wait_ring(pool), keys.pool_queued(pool), sandbox_id, address, secret, f"{now:.3f}",
                  3_600_000, keys.pool_wait_queue_prefix(pool), keys.waiter_prefix, keys.promised) in (1, 2)
    return sandbox_id


@dataclass
class ServedApp:
    """An ASGI app under uvicorn in a thread of this process, on a loopback port."""

    app: Any
    port: int = field(default_factory=free_port)
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServedApp:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on", loop="asyncio", http="httptools", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout=15, what="uvicorn start")
        if not self.server.started:
            raise AssertionError("the app did not start")
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(15)


class SchedulerProcess:
    """`sandpool scheduler` as a real subprocess (for multi-replica and crash tests)."""

    def __init__(self, redis_url: str, prefix: str, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="sched", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            # No controller starts sandboxes for waiters here: fail fast unless `extra` says otherwise.
            [sys.executable, "-m", "sandpool", "scheduler", "--standalone", "--no-controller",
             "--capacity-wait-seconds", "0",
             "--port", str(self.port), "--redis-url", redis_url, "--redis-prefix", prefix, *extra],
            stdout=self.log, stderr=self.log, env={**os.environ, **(env or {})},
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"scheduler exited: {Path(self.log.name).read_text()[-3000:]}")
            try:
                return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=30, interval=0.05, what="scheduler ready")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        Path(self.log.name).unlink(missing_ok=True)


SHORT = {"max_concurrent": "max_concurrent_sessions", "max_idle": "max_idle_timeout_seconds",
         "max_lifetime": "max_lifetime_seconds", "max_exec": "max_exec_timeout_seconds",
         "budget": "daily_session_seconds_budget"}


def tenant_headers(workspace: str, **policy: int) -> dict[str, str]:
    """What the proxy injects: the workspace and every forwarded limit (0: none of its own)."""
    values = {SHORT.get(k, k): v for k, v in policy.items()}
    out = {"Authorization": f"Bearer {INTERNAL_TOKEN}", tenancy.WORKSPACE: workspace}
    for limit in catalogue.forwarded():
        assert limit.header is not None
        out[limit.header] = str(values.get(limit.name, limit.unset))
    return out
