"""A real api (multi-tenant: the edge over the session layer) + agents stack for the edge's end-to-end tests.

No pool controller runs; sandboxes are real `sandpool agent` processes on Unix
sockets (or fake records where only a lease matters), published to Redis exactly
as the controller does (docs/architecture.md, "Sandbox lifecycle in Redis"), so
every test decides how many sandboxes exist and nothing depends on a provider's
start-up time.
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
from testkit import AgentProcess, start_agents

from sandpool.state.keys import Keys, egress_digest

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
        fresh = start_agents(self.root, count)
        self.agents.extend(fresh)
        return fresh

    def publish(self, *, address: str = "unix:///nonexistent.sock", secret: str = "unused",
                pool: str = "default", image: str = "python", egress: str | None = None) -> str:
        """Publish a ready sandbox; `egress`: its egress credential (known in Redis by its digest only)."""
        sandbox_id = "sb-" + uuid.uuid4().hex[:12]
        now = time.time()
        self.rdb.hset(self.keys.sandbox(sandbox_id), mapping={"state": "starting", "pool": pool, "image": image,
                                                              "created_at": now, "owner": "edge-tests"})
        self.rdb.sadd(self.keys.pool_members(pool), sandbox_id)
        ready = {"state": "ready", "address": address, "secret": secret, "ready_at": time.time()}
        if egress is not None:
            ready["egress"] = egress_digest(egress)
        self.rdb.hset(self.keys.sandbox(sandbox_id), mapping=ready)
        self.rdb.rpush(self.keys.pool_ready(pool), sandbox_id)
        return sandbox_id

    def publish_agents(self, count: int) -> None:
        for agent in self.start_agents(count):
            self.publish(address=agent.address, secret=agent.secret)

    def ready(self, pool: str = "default") -> int:
        return int(self.rdb.llen(self.keys.pool_ready(pool)))

    def stop(self) -> None:
        for agent in self.agents:
            agent.kill()
        shutil.rmtree(self.root, ignore_errors=True)


PRINT_1 = {"tool": "code_execution", "input": {"code": "print(1)"}}


@dataclass
class Stack:
    """A multi-tenant api in a thread of the test process, real agents, one Redis."""

    api: CaplogServer
    keys: SigningKeys
    sandboxes: Sandboxes
    rdb: redis.Redis
    rkeys: Keys

    def client(self, workspace: str, *, admin: bool = False) -> httpx.Client:
        token = self.keys.token(workspace, admin=admin)
        return httpx.Client(base_url=self.api.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)

    def ready(self, pool: str = "default") -> int:
        return self.sandboxes.ready(pool)
