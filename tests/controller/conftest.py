"""Fixtures for the pool controller: a real Redis (the shared server, a key prefix of the
test's own), a real local provider and real agents."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings
from sandpool.state.keys import Keys


@pytest.fixture
def data_dir():
    path = Path(tempfile.mkdtemp(prefix="sp", dir="/tmp"))
    path.chmod(0o711)
    yield path
    asyncio.run(LocalProvider(LocalProviderSettings(data_dir=path, launcher="subprocess")).destroy_all())
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def redis(redis_url: str):
    client = aioredis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=5)
    yield client
    await client.aclose()


@pytest.fixture
def keys(redis_prefix: str) -> Keys:
    return Keys(prefix=redis_prefix)


@pytest.fixture
async def make_provider(data_dir: Path):
    """Started providers on the test's data dir, closed at the end (the zygote launcher owns a process)."""
    made: list[LocalProvider] = []

    async def make(**overrides) -> LocalProvider:
        p = LocalProvider(LocalProviderSettings(data_dir=data_dir, start_timeout_seconds=30, **overrides))
        made.append(p)
        await p.start()
        return p

    yield make
    for p in made:
        await p.close()


@pytest.fixture
async def provider(make_provider):
    return await make_provider()


@pytest.fixture
async def tasks():
    """Background tasks (controllers) cancelled and awaited at the end of the test."""
    started: list[asyncio.Task] = []
    yield started
    for task in started:
        task.cancel()
    for task in started:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 30)
