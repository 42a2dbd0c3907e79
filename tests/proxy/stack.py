"""A real proxy + multi-tenant scheduler + agents stack for the proxy's end-to-end tests.

The scheduler runs without its pool controller; sandboxes are real `sandpool
agent` processes on Unix sockets, published to Redis exactly as the controller
does (docs/architecture.md, "Sandbox lifecycle in Redis"), so every test decides
how many sandboxes exist and nothing depends on a provider's start-up time.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import redis

from sandpool.state.keys import Keys

if TYPE_CHECKING:
    from .conftest import Keys as SigningKeys
    from .conftest import ThreadServer


def wait_for(predicate, *, timeout: float = 20.0, what: str = "") -> None:  # type: ignore[no-untyped-def]  # predicate: any no-argument callable
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    socket_path: Path
    secret: str
    log: Path

    @property
    def address(self) -> str:
        return f"unix://{self.socket_path}"

    def healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited: {self.log.read_text()[-2000:]}")
        if not self.socket_path.exists():
            return False
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket_path)), base_url="http://agent",
                              timeout=1) as client:
                return client.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False


class Sandboxes:
    """Real agents (short socket paths: sun_path is 108 bytes) and their publication in Redis."""

    def __init__(self, rdb: redis.Redis, keys: Keys) -> None:
        self.rdb = rdb
        self.keys = keys
        self.root = Path(tempfile.mkdtemp(prefix="spp", dir="/tmp"))
        self.agents: list[Agent] = []

    def start_agents(self, count: int) -> list[Agent]:
        fresh = []
        for _ in range(count):
            name = uuid.uuid4().hex[:8]
            workspace = self.root / f"w{name}"
            workspace.mkdir()
            sock = self.root / f"{name}.sock"
            secret = secrets.token_urlsafe(24)
            log = self.root / f"{name}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "sandpool", "agent", "--uds", str(sock), "--workspace", str(workspace)],
                    env={**os.environ, "SANDPOOL_AGENT_SECRET": secret}, stdout=out, stderr=out,
                    start_new_session=True)
            agent = Agent(proc, sock, secret, log)
            self.agents.append(agent)
            fresh.append(agent)
        for agent in fresh:
            wait_for(agent.healthy, timeout=30, what="agent health")
        return fresh

    def publish(self, *, address: str = "unix:///nonexistent.sock", secret: str = "unused",
                pool: str = "default", image: str = "python") -> str:
        sandbox_id = "sb-" + uuid.uuid4().hex[:12]
        now = time.time()
        self.rdb.hset(self.keys.sandbox(sandbox_id), mapping={"state": "starting", "pool": pool, "image": image,
                                                              "created_at": now, "owner": "proxy-tests"})
        self.rdb.sadd(self.keys.pool_members(pool), sandbox_id)
        self.rdb.hset(self.keys.sandbox(sandbox_id), mapping={"state": "ready", "address": address,
                                                              "secret": secret, "ready_at": time.time()})
        self.rdb.rpush(self.keys.pool_ready(pool), sandbox_id)
        return sandbox_id

    def publish_agents(self, count: int) -> None:
        for agent in self.start_agents(count):
            self.publish(address=agent.address, secret=agent.secret)

    def stop(self) -> None:
        for agent in self.agents:
            if agent.proc.poll() is None:
                try:
                    os.killpg(agent.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                agent.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)


PRINT_1 = {"tool": "code_execution", "input": {"code": "print(1)"}}


@dataclass
class Stack:
    """A proxy and a multi-tenant scheduler in threads of the test process, real agents, one Redis."""

    proxy: ThreadServer
    scheduler: ThreadServer
    keys: SigningKeys
    sandboxes: Sandboxes
    rdb: redis.Redis
    rkeys: Keys

    def client(self, workspace: str, *, admin: bool = False) -> httpx.Client:
        token = self.keys.token(workspace, admin=admin)
        return httpx.Client(base_url=self.proxy.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def ready(self, pool: str = "default") -> int:
        return int(self.rdb.llen(self.rkeys.pool_ready(pool)))
