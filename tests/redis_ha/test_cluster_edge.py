"""The edge's end-to-end tests, unchanged, on a 3-primary Redis Cluster: the six operations through
the multi-tenant api, tenancy on each, the concurrency quota under concurrent creates, the daily
budget, and usage exact across an api restart (tests/edge/test_e2e.py). Only the Redis under them
differs: the api gets `redis+cluster://` and the test's own reads go through a Cluster client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from edge.conftest import api, keys, make_api, other_keys, sandboxes, stack, stack_factory  # noqa: F401 - its fixtures
from edge.test_e2e import *  # noqa: F403 - every test of the module, collected here against the Cluster
from ha_servers import Cluster


@pytest.fixture
def redis_url(redis_cluster: Cluster) -> str:
    return redis_cluster.url


@pytest.fixture
def rdb(redis_cluster: Cluster, redis_prefix: str) -> Iterator[redis.RedisCluster]:
    client = redis_cluster.client()
    yield client
    for key in client.scan_iter(match="{" + redis_prefix + "}:*", count=1000):  # this test's keys only
        client.delete(key)
    client.close()
