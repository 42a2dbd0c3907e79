"""Fixtures for the local provider: a short data dir every uid can traverse, real agents."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import pytest

from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings


@pytest.fixture
def data_dir():
    # Under /tmp (not pytest's 0700 tmp dir): sandboxed code runs as another uid and must
    # reach its workspace; and short, because agent socket paths are capped at 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="sp", dir="/tmp"))
    path.chmod(0o711)
    yield path
    asyncio.run(LocalProvider(LocalProviderSettings(data_dir=path, launcher="subprocess")).destroy_all())
    shutil.rmtree(path, ignore_errors=True)
