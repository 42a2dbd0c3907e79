"""Shared fixtures: a real `redis-server` the tests start themselves, on a free port.

Tests never flush a shared database: each test gets its own key prefix, and
the server is private to the test session.
"""

from __future__ import annotations

import collections
import os
import uuid
from typing import Any

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


SHARED_BY_DIRECTORY = {"chart", "client", "cluster", "isolation", "kubernetes", "redis_ha", "security"}
"""Directories whose tests share a costly session-scoped fixture (a zygote, a real API server, a Redis
Cluster, a `sandpool up`, the one real cluster)."""

LONGEST_FIRST = ("tests/reliability/test_soak.py", "tests/isolation", "tests/kubernetes", "tests/redis_ha",
                 "tests/chart", "tests/client", "tests/security", "tests/e2e/test_egress_pip.py",
                 "tests/reliability/test_chaos.py", "tests/reliability/test_replicas.py")
"""The longest units of work, handed out first so the run does not end on one worker's long tail. A
hint only: a unit missing here runs in collection order after these."""


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """The suite runs in two xdist workers (`-n 2`, pyproject.toml). Each worker gets whole files, and
    a `SHARED_BY_DIRECTORY` directory whole, so a module or shared session fixture is built once, not
    once per worker. (xdist's `--dist loadgroup` would say it with markers, but cannot rename a test's
    id under pytest 9, so its groups are silently ignored.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByFixtureScope(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            parts = path.split("/")
            return "/".join(parts[:2]) if len(parts) > 2 and parts[1] in SHARED_BY_DIRECTORY else path

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:
                self.ordered = True
                rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
                units = sorted(self.workqueue, key=lambda unit: rank.get(unit, len(rank)))
                self.workqueue = collections.OrderedDict((unit, self.workqueue[unit]) for unit in units)
            super()._assign_work_unit(node)

    return ByFixtureScope(config, log)
