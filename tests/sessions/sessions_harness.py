"""Real parts for the session-layer tests: agents on Unix sockets, sandboxes published per the
lifecycle in docs/architecture.md, the api (and the controller) served by uvicorn on loopback, the
session reaper the controller runs, and `sandpool api` as a real subprocess (the processes, servers
and polling are tests/testkit.py's)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from prometheus_client import generate_latest
from testkit import AgentProcess, ThreadServer, free_port, start_agents, wait_for, wait_http

from sandpool.edge.keys_cli import mint_token
from sandpool.edge.policy import dump_policy, policy_model
from sandpool.state import scripts
from sandpool.state.keys import Keys


class Agents:
    """Starts real `sandpool agent` processes on Unix sockets (short paths: sun_path is 108 bytes)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="spa", dir="/tmp"))
        self.started: list[AgentProcess] = []

    def start(self, count: int = 1) -> list[AgentProcess]:
        fresh = start_agents(self.root, count, workspace_prefix="ws-")
        self.started.extend(fresh)
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
    assert r.eval(scripts.REGISTER_STARTING, 3, keys.sandbox(sandbox_id), keys.pool_members(pool),
                  keys.pool_starting(pool),
                  *scripts.named(sandbox=sandbox_id, ceiling=1 << 30, pool=pool, image=image, created_at=f"{now:.3f}",
                                 owner="tests", record_ttl_ms=3_600_000)) == 1
    assert r.eval(scripts.PUBLISH_READY, 6, keys.sandbox(sandbox_id), keys.pool_ready(pool), keys.pool_members(pool),
                  keys.pool_wait_ring(pool), keys.pool_queued(pool), keys.pool_starting(pool),
                  *scripts.named(sandbox=sandbox_id, address=address, secret=secret, ready_at=f"{now:.3f}",
                                 record_ttl_ms=3_600_000, queue_prefix=keys.pool_wait_queue_prefix(pool),
                                 waiter_prefix=keys.waiter_prefix, promised=keys.promised, egress="")) in (1, 2)
    return sandbox_id


class ServedApp(ThreadServer):
    """An ASGI app under uvicorn in a thread of this process, on a loopback port (its own event loop
    and HTTP parser, as `sandpool api` runs it)."""

    start_timeout = 15.0

    def __init__(self, app: Any) -> None:
        super().__init__(app, log_level="warning", lifespan="on", loop="asyncio", http="httptools",
                         access_log=False)


@dataclass
class Tenants:
    """A multi-tenant api and the key pair it trusts: real bearer tokens, policies stored as the admin
    API stores them (the policy model's JSON under the workspace's policy key)."""

    server: ServedApp
    private_key: Path
    r: redis.Redis
    keys: Keys

    @property
    def url(self) -> str:
        return self.server.url

    def token(self, workspace: str, **claims: Any) -> str:
        return mint_token(self.private_key, workspace, **claims)

    def headers(self, workspace: str, **policy: Any) -> dict[str, str]:
        """The Authorization header of a fresh token of `workspace`; with `policy`, its policy is stored
        first (limits by catalogue name or the short names of SHORT)."""
        if policy:
            self.set_policy(workspace, **policy)
        return {"Authorization": f"Bearer {self.token(workspace)}"}

    def set_policy(self, workspace: str, **policy: Any) -> None:
        values = {SHORT.get(name, name): value for name, value in policy.items()}
        self.r.set(self.keys.workspace_policy(workspace), dump_policy(policy_model()(**values)))


SHORT = {"max_concurrent": "max_concurrent_sessions", "max_idle": "max_idle_timeout_seconds",
         "max_lifetime": "max_lifetime_seconds", "max_exec": "max_exec_timeout_seconds",
         "budget": "daily_session_seconds_budget"}


class Reaper:
    """The controller's session reaper, alone, on an event loop of its own in a thread (tests of the
    api's sessions that need idle and lifetime reaping, without a provider)."""

    def __init__(self, redis_url: str, prefix: str, *, interval: float = 0.1) -> None:
        from sandpool.controller.metrics import ControllerMetrics

        self.redis_url, self.prefix, self.interval = redis_url, prefix, interval
        self.metrics = ControllerMetrics.create()
        self.loop = asyncio.new_event_loop()
        self.stopping: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),), daemon=True)

    async def _run(self) -> None:
        from sandpool.controller.reaper import SessionReaper
        from sandpool.state import close, connect
        from sandpool.state.sessions import SessionStore

        self.stopping = asyncio.Event()
        client = connect(self.redis_url, timeout=2)
        try:
            store = SessionStore(client, Keys(self.prefix))
            await SessionReaper(store, self.metrics, interval=self.interval, batch=256).run(self.stopping)
        finally:
            await close(client)

    def start(self) -> Reaper:
        self.thread.start()
        wait_for(lambda: self.stopping is not None, timeout=10, what="the reaper running")
        return self

    def metrics_text(self) -> str:
        return generate_latest(self.metrics.registry).decode()

    def stop(self) -> None:
        if self.stopping is not None:
            self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(15)
        self.loop.close()


class ApiProcess:
    """`sandpool api --no-auth` as a real subprocess (for multi-replica and crash tests)."""

    def __init__(self, redis_url: str, prefix: str, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="api", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            # No controller starts sandboxes for waiters here: fail fast unless `extra` says otherwise.
            [sys.executable, "-m", "sandpool", "api", "--no-auth", "--capacity-wait-seconds", "0",
             "--port", str(self.port), "--redis-url", redis_url, "--redis-prefix", prefix, *extra],
            stdout=self.log, stderr=self.log, env={**os.environ, **(env or {})},
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        wait_http(self.url + "/readyz", proc=self.proc, log=Path(self.log.name), timeout=30, what="api ready")

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


def ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
