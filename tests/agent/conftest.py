"""Fixtures of the agent tests; the helpers live in `agent_harness` (a conftest is no importable module:
several directories have one, and `from conftest import ...` finds whichever was imported first)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from agent_harness import Agent, start_agent


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    a = start_agent(tmp_path_factory.mktemp("agent"), "--interrupt-grace-seconds", "0.5")
    yield a
    a.stop()
