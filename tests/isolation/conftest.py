"""Fixtures for the isolation suite: one real zygote for the session, sandboxes per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .harness import Harness


@pytest.fixture(scope="session")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    if os.geteuid() != 0:
        pytest.skip("isolation tests need root (namespaces, cgroups)")
    # A short base path: agent socket paths must fit in sun_path.
    h = Harness(tmp_path_factory.mktemp("iso"))
    yield h
    h.close()
