"""Fixtures for the isolation suite: one real zygote for the session, sandboxes per test."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from .harness import Harness


@pytest.fixture(scope="session")
def harness() -> Iterator[Harness]:
    if os.geteuid() != 0:
        pytest.skip("isolation tests need root (namespaces, cgroups)")
    h = Harness()
    yield h
    h.close()
