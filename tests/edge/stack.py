"""A real proxy + multi-tenant scheduler + agents stack for the proxy's end-to-end tests.

The scheduler runs without its pool controller; sandboxes are real `sandpool
agent` processes on Unix sockets, published to Redis exactly as the controller
does (docs/architecture.md, "Sandbox lifecycle in Redis"), so every test decides
how many sandboxes exist and nothing depends on a provider's start-up time.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import redis
from testkit import AgentProcess

from sandpool.state.keys import Keys

if TYPE_CHECKING:
    from .conftest import CaplogServer
    from .conftest import Keys as SigningKeys


class Sandboxes:
    """Real agents (short socket paths: sun_path is 108 bytes) and their publication in Redis."""

    def __init__(self, rdb: redis.Redis, keys: Keys) -> None:
        self.rdb = rdb
        self.keys = keys
        self.root = Path(tempfile.mkdtemp(prefix="spp", dir="/tmp"))
        self.agents: list[AgentProcess] = []

    def start_agents(self, count: int) -> list[AgentProcess]:
        fresh = []
        for _ in range(count):
            name = uuid.uuid4().hex[:8]
            agent = AgentProcess(self.root / f"w{name}", self.root / f"{name}.log",
                                 socket_path=self.root / f"{name}.sock").start()
            self.agents.append(agent)
            fresh.append(agent)
        for agent in fresh:
            agent.wait_healthy(timeout=30)
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
            agent.kill()
        shutil.rmtree(self.root, ignore_errors=True)


PRINT_1 = {"tool": "code_execution", "input": {"code": "print(1)"}}


@dataclass
class Stack:
    """A proxy and a multi-tenant scheduler in threads of the test process, real agents, one Redis."""

    proxy: CaplogServer
    scheduler: CaplogServer
    keys: SigningKeys
    sandboxes: Sandboxes
    rdb: redis.Redis
    rkeys: Keys

    def client(self, workspace: str, *, admin: bool = False) -> httpx.Client:
        token = self.keys.token(workspace, admin=admin)
        return httpx.Client(base_url=self.proxy.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def ready(self, pool: str = "default") -> int:
        return int(self.rdb.llen(self.rkeys.pool_ready(pool)))
