"""Fixtures of the end-to-end tests; the helpers live in `up_harness` (a conftest is no importable module)."""

from __future__ import annotations

from typing import Any

import pytest
from up_harness import Up


@pytest.fixture
def up_factory():
    started: list[Up] = []

    def start(*args: str, **kwargs: Any) -> Up:
        up = Up(*args, **kwargs)
        started.append(up)
        return up

    yield start
    for up in started:
        up.cleanup()
