"""Fixtures of the scheduler tests: the real Redis of tests/conftest.py, real agents, the app on loopback."""

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

from sched_harness import INTERNAL_TOKEN, Agents, ServedApp

from sandpool.sessions.app import create_app
from sandpool.sessions.settings import SchedulerSettings
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
def scheduler(redis_url: str, redis_prefix: str) -> Iterator[Callable[..., ServedApp]]:
    """Serve a scheduler app with the given settings overrides (standalone, no controller by default)."""
    served: list[ServedApp] = []

    def make(**overrides: Any) -> ServedApp:
        # No controller runs here (tests publish sandboxes themselves), so by default nothing
        # is started for a waiter either: fail fast unless a test asks to wait.
        values: dict[str, Any] = {"standalone": True, "controller": False, "redis_url": redis_url,
                                  "redis_prefix": redis_prefix, "reap_interval_seconds": 0.1,
                                  "capacity_wait_seconds": 0}
        values.update(overrides)
        app = create_app(SchedulerSettings(**values))
        server = ServedApp(app).start()
        served.append(server)
        return server

    yield make
    for server in served:
        server.stop()


@pytest.fixture
def tenant_scheduler(scheduler: Callable[..., ServedApp], monkeypatch: pytest.MonkeyPatch) -> Callable[..., ServedApp]:
    """A multi-tenant scheduler (internal credential from the environment, as in production)."""
    monkeypatch.setenv("SANDPOOL_INTERNAL_TOKEN", INTERNAL_TOKEN)

    def make(**overrides: Any) -> ServedApp:
        return scheduler(standalone=False, **overrides)

    return make


@pytest.fixture
def data_dir() -> Iterator[Path]:
    """The local provider's directory; every sandbox left in it is destroyed afterwards."""
    from sandpool.providers import build_provider

    path = Path(tempfile.mkdtemp(prefix="sps", dir="/tmp"))
    yield path

    async def destroy_all() -> None:
        provider = build_provider("local", None, data_dir=path)
        await provider.start()
        try:
            await provider.destroy_all()
        finally:
            await provider.close()

    asyncio.run(destroy_all())
    shutil.rmtree(path, ignore_errors=True)
