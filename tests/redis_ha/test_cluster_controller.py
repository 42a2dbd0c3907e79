"""The api beside `sandpool controller` and the local provider, unchanged, on a 3-primary Redis
Cluster (tests/sessions/test_api_with_controller.py): the controller's scripts (warm, reconcile,
reap, pool statistics) and its nudge channel run there as on one server. The session tests'
fixtures come from their conftest, loaded by path (it is not importable by name)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from ha_servers import Cluster

TESTS = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path) -> object:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fixtures = _load("redis_ha_sessions_fixtures", TESTS / "sessions" / "conftest.py")
_tests = _load("redis_ha_sessions_with_controller", TESTS / "sessions" / "test_api_with_controller.py")
globals().update({name: getattr(_fixtures, name) for name in (  # every fixture of theirs but `r`, redefined below
    "keys", "agents", "served", "api", "signing_key", "tenant_api", "controller", "reaper", "data_dir")})
globals().update({name: test for name, test in vars(_tests).items() if name.startswith("test_")})


@pytest.fixture
def redis_url(redis_cluster: Cluster) -> str:
    return redis_cluster.url


@pytest.fixture
def r(redis_cluster: Cluster, redis_prefix: str) -> Iterator[redis.RedisCluster]:
    client = redis_cluster.client()
    yield client
    for key in client.scan_iter(match="{" + redis_prefix + "}:*", count=1000):  # this test's keys only
        client.delete(key)
    client.close()
