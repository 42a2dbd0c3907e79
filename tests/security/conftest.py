"""One real stack for the security tables: Redis, `sandpool controller` with real local sandboxes,
and a multi-tenant `sandpool api` trusting a key of the test's own (tests/reliability/sp_harness.py).

The tables here extend the per-component ones (tests/agent, tests/edge,
tests/isolation) by running them through the whole deployed path, and reuse
those tables rather than copying them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS / "reliability"))
if str(TESTS) not in sys.path:
    sys.path.append(str(TESTS))  # `edge.test_auth`: the edge suite's table of bad credentials

from sp_harness import Stack, build_stack  # noqa: E402 - it needs the sys.path lines above

POOL = 3


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    built = build_stack(auth=True, pool_size=POOL, max_sandboxes=POOL + 4,
                        api_args=["--capacity-wait-seconds", "5", "--max-exec-timeout-seconds", "20"])
    yield built
    built.close()
