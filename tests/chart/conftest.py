"""Fixtures of the chart tests: a real helm 3 binary, renders, and a fake API server.

helm is the one `.ci/run` installed (`.ci/install-helm`, named in
`SANDPOOL_TEST_HELM`) or one on PATH; without it the chart tests skip with a
one-line reason. A test never installs it. Renders are cached per (values files, --set) so the
many assertions on one scenario cost one `helm template`.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from chart_support import FakeApiServer, Helm
from testkit import tool


@pytest.fixture(scope="session")
def helm() -> Helm:
    return Helm(tool("helm"))


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()
    server.thread.join(5)
