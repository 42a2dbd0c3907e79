"""Fixtures of the soak and chaos suites: real processes from sp_harness, and a workload driver.

`SANDPOOL_LONG=1` runs the long versions (soak of 10,000 sessions, longer chaos);
by default CI runs the short forms. Tests marked `slow` run only when it is set.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sp_harness import LONG, Stack


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if LONG:
        return
    skip = pytest.mark.skip(reason="long version: set SANDPOOL_LONG=1 (make test-long)")
    here = Path(__file__).resolve().parent
    for item in items:
        if "slow" in item.keywords and here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def stacks() -> Iterator[list[Stack]]:
    """Stacks a test builds; all closed (processes ended, sandboxes destroyed) at its end."""
    built: list[Stack] = []
    yield built
    for stack in built:
        stack.close()
