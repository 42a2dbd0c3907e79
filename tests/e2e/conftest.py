"""Fixtures of the end-to-end tests; the helpers live in `up_harness` (a conftest is no importable module)."""

from __future__ import annotations

from typing import Any

import pytest
from sandbox_env import host_python
from up_harness import Up


@pytest.fixture(autouse=True)
def _sandbox_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `sandpool up` here runs sandboxes on the built environment when `.ci/run` made one, else on
    the host's Python: a test never has up build the scientific stack (test_sandbox_environment
    builds small ones)."""
    monkeypatch.setenv("SANDPOOL_SANDBOX_PYTHON", host_python())


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
