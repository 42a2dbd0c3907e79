"""Real parts for the scheduler tests: agents on Unix sockets, sandboxes published per the
lifecycle in docs/architecture.md, and the app served by uvicorn on loopback (the processes,
servers and polling are tests/testkit.py's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from testkit import AgentProcess, ThreadServer, free_port, injected_headers, wait_http

from sandpool.state import scripts
from sandpool.state.keys import Keys

INTERNAL_TOKEN = "test-internal-credential-0123456789"


class Agents:
    """Starts real `sandpool agent` processes on Unix sockets (short paths: sun_path is 108 bytes)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="spa", dir="/tmp"))
        self.started: list[AgentProcess] = []

    def start(self, count: int = 1) -> list[AgentProcess]:
        fresh = []
        for _ in range(count):
            name = uuid.uuid4().hex[:8]
            agent = AgentProcess(self.root / f"ws-{name}", self.root / f"{name}.log",
                                 socket_path=self.root / f"{name}.sock").start()
            self.started.append(agent)
            fresh.append(agent)
        for agent in fresh:
            agent.wait_healthy(timeout=30)
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


class ServedApp(ThreadServer):
    """An ASGI app under uvicorn in a thread of this process, on a loopback port (the scheduler's own
    event loop and HTTP parser, as `sandpool scheduler` runs it)."""

    start_timeout = 15.0

    def __init__(self, app: Any) -> None:
        super().__init__(app, log_level="warning", lifespan="on", loop="asyncio", http="httptools",
                         access_log=False)


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
        wait_http(self.url + "/readyz", proc=self.proc, log=Path(self.log.name), timeout=30, what="scheduler ready")

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
    return injected_headers(INTERNAL_TOKEN, workspace, **{SHORT.get(k, k): v for k, v in policy.items()})
