"""Fixtures of the session-layer tests: the real Redis of tests/conftest.py, real agents, the api (and
the controller) on loopback.

`api(**overrides)` serves `sandpool api --no-auth` (standalone: the session layer alone, one trusted
client); `tenant_api(**overrides)` serves a multi-tenant api trusting a key pair of the test's own, so
tenancy comes from real bearer tokens; `controller(provider=..., **overrides)` serves `sandpool
controller` beside it on the same Redis; `reaper` runs the controller's session reaper alone.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

sys.path.insert(0, str(Path(__file__).parent))

from sessions_harness import Agents, Reaper, ServedApp, Tenants

from sandpool.api.app import create_app
from sandpool.api.settings import ApiSettings
from sandpool.edge.keys_cli import generate_keypair
from sandpool.state.keys import Keys


@pytest.fixture
def keys(redis_prefix: str) -> Keys:
    return Keys(redis_prefix)


@pytest.fixture
def r(redis_url: str, redis_prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    # Leave nothing behind: this test's keys only (its own prefix), never a flush.
    for key in client.scan_iter(match="{" + redis_prefix + "}:*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture
def agents() -> Iterator[Agents]:
    started = Agents()
    yield started
    started.stop()


@pytest.fixture
def served() -> Iterator[list[ServedApp]]:
    """Every app a test serves, stopped in reverse order (the api before the controller it shares Redis with)."""
    started: list[ServedApp] = []
    yield started
    for server in reversed(started):
        server.stop()


@pytest.fixture
def api(redis_url: str, redis_prefix: str, served: list[ServedApp]) -> Callable[..., ServedApp]:
    """Serve a standalone api (`--no-auth`) with the given settings overrides."""

    def make(**overrides: Any) -> ServedApp:
        # No controller runs unless a test serves one (most publish sandboxes themselves), so by
        # default nothing is started for a waiter either: fail fast unless a test asks to wait.
        values: dict[str, Any] = {"auth": False, "redis_url": redis_url, "redis_prefix": redis_prefix,
                                  "capacity_wait_seconds": 0}
        values.update(overrides)
        server = ServedApp(create_app(ApiSettings(**values))).start()
        served.append(server)
        return server

    return make


@pytest.fixture
def signing_key(tmp_path: Path) -> tuple[Path, Path]:
    return generate_keypair(tmp_path / "keys" / "signing.pem")


@pytest.fixture
def tenant_api(redis_url: str, redis_prefix: str, served: list[ServedApp], signing_key: tuple[Path, Path],
               r: redis.Redis, keys: Keys) -> Callable[..., Tenants]:
    """Serve a multi-tenant api trusting the test's own key pair (tokens minted with its private key)."""
    private, public = signing_key

    def make(**overrides: Any) -> Tenants:
        values: dict[str, Any] = {"auth_public_keys": [str(public)], "redis_url": redis_url,
                                  "redis_prefix": redis_prefix, "capacity_wait_seconds": 0}
        values.update(overrides)
        server = ServedApp(create_app(ApiSettings(**values))).start()
        served.append(server)
        return Tenants(server, private, r, keys)

    return make


class Controllers:
    """Serves `sandpool controller` apps on the test's Redis, their local sandboxes in `data_dir`."""

    def __init__(self, redis_url: str, redis_prefix: str) -> None:
        self.redis_url, self.redis_prefix = redis_url, redis_prefix
        self.data_dir = Path(tempfile.mkdtemp(prefix="sps", dir="/tmp"))
        self.started: list[ServedApp] = []

    def __call__(self, *, provider: Any = None, **overrides: Any) -> ServedApp:
        from sandpool.controller.app import create_app as create_controller
        from sandpool.controller.settings import ControllerSettings

        values: dict[str, Any] = {"redis_url": self.redis_url, "redis_prefix": self.redis_prefix,
                                  "data_dir": self.data_dir, "reap_interval_seconds": 0.1}
        values.update(overrides)
        server = ServedApp(create_controller(ControllerSettings(**values), provider=provider))
        server.start_timeout = 60.0  # the provider starts first (the local one: its zygote)
        server.start()
        self.started.append(server)
        return server

    def stop(self) -> None:
        for server in reversed(self.started):
            server.stop()
        destroy_sandboxes(self.data_dir)


@pytest.fixture
def controller(redis_url: str, redis_prefix: str) -> Iterator[Controllers]:
    """`controller(provider=None, **overrides)` serves `sandpool controller` (pools, provider, session
    reaper) on the test's Redis; afterwards every sandbox left in its data dir is destroyed."""
    controllers = Controllers(redis_url, redis_prefix)
    yield controllers
    controllers.stop()


@pytest.fixture
def reaper(redis_url: str, redis_prefix: str) -> Iterator[Reaper]:
    """The controller's session reaper, running alone (no provider) every 0.1 s."""
    running = Reaper(redis_url, redis_prefix).start()
    yield running
    running.stop()


def destroy_sandboxes(path: Path) -> None:
    """Destroy every local sandbox left in `path`, then remove it."""
    from sandpool.providers import build_provider

    async def destroy_all() -> None:
        provider = build_provider("local", None, data_dir=path)
        await provider.start()
        try:
            await provider.destroy_all()
        finally:
            await provider.close()

    asyncio.run(destroy_all())
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """A local provider's directory for a test that runs one itself; every sandbox left in it is
    destroyed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="sps", dir="/tmp"))
    yield path
    destroy_sandboxes(path)
