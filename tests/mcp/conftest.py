"""Fixtures of the MCP tests; the helpers live in `mcp_harness` (a conftest is no importable module)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

sys.path.insert(0, str(Path(__file__).parent))

from mcp_harness import ApiReplica, Sandboxes, token

from sandpool.edge.keys_cli import generate_keypair
from sandpool.state.keys import Keys


@dataclass
class Stack:
    """Two api replicas on one Redis, the sandboxes published for them, and the key their tokens are signed with."""

    apis: list[ApiReplica]
    sandboxes: Sandboxes
    private_key: Path
    r: redis.Redis
    keys: Keys

    @property
    def urls(self) -> list[str]:
        return [api.url for api in self.apis]

    def token(self, workspace: str) -> str:
        return token(self.private_key, workspace)


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack per module (the api processes start once); each test leases its own sessions."""
    prefix = "tmcp" + tmp_path_factory.mktemp("p").name[-6:].replace("-", "")
    private, public = generate_keypair(tmp_path_factory.mktemp("keys") / "signing.pem")
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    keys = Keys(prefix)
    apis = [ApiReplica(redis_server.url, prefix, public) for _ in range(2)]
    sandboxes = Sandboxes(redis_server.url, keys)
    try:
        for api in apis:
            api.wait_ready()
        yield Stack(apis, sandboxes, private, r, keys)
    finally:
        for api in apis:
            api.stop()
        sandboxes.stop()
        for key in r.scan_iter(match="{" + prefix + "}:*", count=1000):
            r.delete(key)
        r.close()
