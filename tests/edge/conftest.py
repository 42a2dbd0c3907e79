"""Fixtures of the edge tests: a real `sandpool api` app (the edge over the session layer, in process)
served by uvicorn on loopback in a thread of the test process, a real Redis, real keys.

There is no upstream to record: what the edge decides is observed where a client
(or an operator) can see it, in the answers and in Redis. Sandboxes are published
into Redis by the test (tests/edge/stack.py): fake ones where only a lease matters,
real `sandpool agent` processes where calls reach a sandbox.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import testkit

from sandpool.api.app import create_app
from sandpool.api.settings import ApiSettings
from sandpool.edge.keys_cli import generate_keypair, mint_token
from sandpool.state.keys import Keys as RedisKeys

from .stack import Sandboxes, Stack


class CaplogServer(testkit.ThreadServer):
    """A real uvicorn server on a loopback port, in a thread of the test process (logging through the
    test's own handlers, so `caplog` sees it)."""

    def __init__(self, app: Any) -> None:
        # timeout_graceful_shutdown bounds a stop when a peer's request task lingers
        super().__init__(app, log_config=None, lifespan="on", access_log=False, timeout_graceful_shutdown=2)


@dataclass
class Keys:
    private: Path
    public: Path

    def token(self, workspace: str = "acme", **kwargs: Any) -> str:
        return mint_token(self.private, workspace, **kwargs)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    private, public = generate_keypair(tmp_path / "keys" / "signing.pem")
    return Keys(private, public)


@pytest.fixture
def other_keys(tmp_path: Path) -> Keys:
    private, public = generate_keypair(tmp_path / "other" / "untrusted.pem")
    return Keys(private, public)


@dataclass
class Api:
    server: CaplogServer
    settings: ApiSettings

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kwargs)


def api_settings(base: dict[str, Any], keys: Keys, overrides: dict[str, Any]) -> ApiSettings:
    """A multi-tenant api trusting `keys` on the test's Redis (`base`); no capacity wait (no controller
    starts sandboxes here)."""
    return ApiSettings(**{**base, "auth_public_keys": [str(keys.public)], "capacity_wait_seconds": 0, **overrides})


@pytest.fixture
def rdb(redis_url: str, redis_prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    for key in client.scan_iter(match="{" + redis_prefix + "}:*", count=1000):  # this test's keys only
        client.delete(key)
    client.close()


@pytest.fixture
def sandboxes(rdb: redis.Redis, redis_prefix: str) -> Iterator[Sandboxes]:
    made = Sandboxes(rdb, RedisKeys(redis_prefix))
    yield made
    made.stop()


@pytest.fixture
def make_api(redis_url: str, redis_prefix: str, keys: Keys, rdb: redis.Redis) -> Iterator[Callable[..., Api]]:
    started: list[CaplogServer] = []

    def make(**overrides: Any) -> Api:
        settings = api_settings({"redis_url": redis_url, "redis_prefix": redis_prefix}, keys, overrides)
        server = CaplogServer(create_app(settings)).start()
        started.append(server)
        return Api(server, settings)

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def api(make_api: Callable[..., Api]) -> Api:
    return make_api()


@pytest.fixture
def stack_factory(redis_url: str, redis_prefix: str, keys: Keys, rdb: redis.Redis,
                  sandboxes: Sandboxes) -> Iterator[Callable[..., Stack]]:
    rkeys = RedisKeys(redis_prefix)
    servers: list[CaplogServer] = []

    def start(**overrides: Any) -> Stack:
        """A fresh api on the same Redis (call again to 'restart' it)."""
        for server in servers:
            server.stop()
        servers.clear()
        settings = api_settings({"redis_url": redis_url, "redis_prefix": redis_prefix}, keys, overrides)
        server = CaplogServer(create_app(settings)).start()
        servers.append(server)
        return Stack(server, keys, sandboxes, rdb, rkeys)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def stack(stack_factory: Callable[..., Stack]) -> Stack:
    return stack_factory()
