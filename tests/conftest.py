"""Shared fixtures: a real `redis-server` the tests start themselves, on a free port.

Tests never flush a shared database: each test gets its own key prefix, and
the server is private to the test session.
"""

from __future__ import annotations

import os
import uuid

import pytest
from testkit import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of the test's own, so tests share one server without sharing keys."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() != 0:
        skip = pytest.mark.skip(reason="isolation tests need root (namespaces, cgroups)")
        for item in items:
            if "isolation" in item.keywords:
                item.add_marker(skip)
