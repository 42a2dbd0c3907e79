"""Shared fixtures: a real `redis-server` the tests start themselves, on a free port.

Tests never flush a shared database: each test gets its own key prefix, and
the server is private to the test session.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

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


SHARED_BY_DIRECTORY = {"chart", "client", "cluster", "isolation", "kubernetes", "redis_ha", "security"}
"""Directories whose tests share a costly session-scoped fixture (a zygote, a real API server, a Redis
Cluster, a `sandpool up`, the one real cluster): the suite runs in two xdist workers (`--dist loadgroup`,
pyproject.toml), and all of such a directory's tests go to one of them, so the fixture is built once.
Every other file is a group of its own, so its module fixtures are built once too."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    skip = pytest.mark.skip(reason="isolation tests need root (namespaces, cgroups)")
    for item in items:
        if os.geteuid() != 0 and "isolation" in item.keywords:
            item.add_marker(skip)
        relative = item.path.relative_to(root)
        directory = relative.parts[0] if len(relative.parts) > 1 else ""
        item.add_marker(pytest.mark.xdist_group(directory if directory in SHARED_BY_DIRECTORY else str(relative)))

