"""Fixtures of the client tests: a scripted HTTP server, and a real `sandpool up --no-auth` stack."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from client_scripted import ScriptedServer, free_port  # noqa: E402


@pytest.fixture(scope="module")
def scripted_server() -> Iterator[ScriptedServer]:
    server = ScriptedServer(free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def scripted(scripted_server: ScriptedServer) -> ScriptedServer:
    scripted_server.reset()
    return scripted_server
