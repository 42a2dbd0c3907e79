"""Fixtures of the Redis high-availability tests: a 3-primary Cluster for the whole session, and a
fresh primary + replica + 3 Sentinels for each test that kills its primary (tests/redis_ha/ha_servers.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))  # up_harness: `sandpool up` in a subprocess

from ha_servers import Cluster, Replicated


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def replicated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicated]:
    deployment = Replicated(tmp_path_factory.mktemp("sentinel"))
    try:
        deployment.start()
        yield deployment
    finally:
        deployment.stop()
