"""Fixtures of the client tests: a scripted HTTP server, and a real `sandpool up --no-auth` stack."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from client_scripted import ScriptedServer
from client_stack import Stack, StackUnavailable, up_help
from testkit import free_port


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


POOL_SIZE = 2
MAX_BODY_BYTES = 256 * 1024


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """One `sandpool up --no-auth` for all the client's stack tests: a pool of 2 with a ceiling of 2.

    The ceiling equal to the warm target makes capacity reachable by holding two
    sessions; a small body cap makes 413 reachable with a small upload.
    """
    external = os.environ.get("SANDPOOL_CLIENT_TEST_URL")
    if external:
        # Run against a stack someone else started (a deployment, an api started by hand);
        # the tests that need a known ceiling or body cap skip unless they are given.
        s = Stack.external(external, token=os.environ.get("SANDPOOL_CLIENT_TEST_TOKEN"), limits={
            name: int(os.environ[f"SANDPOOL_CLIENT_TEST_{name.upper()}"])
            for name in ("max_sandboxes", "max_body_bytes") if f"SANDPOOL_CLIENT_TEST_{name.upper()}" in os.environ})
        yield s
        return
    try:
        help_text = up_help()
    except StackUnavailable as exc:
        pytest.skip(str(exc))
    extra = ["--pool-size", str(POOL_SIZE)]
    limits: dict[str, int] = {}
    if "--max-sandboxes" in help_text:
        extra += ["--max-sandboxes", str(POOL_SIZE)]
        limits["max_sandboxes"] = POOL_SIZE
    # `up` has no flag for the body cap; its children read every setting from the environment too.
    env = {"SANDPOOL_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}
    limits["max_body_bytes"] = MAX_BODY_BYTES
    s = Stack(free_port(), extra, env=env)
    s.limits = limits
    try:
        s.start()
        yield s
    finally:
        s.stop()
        s.remove()


@pytest.fixture(scope="module")
def auth_stack() -> Iterator[Stack]:
    """`sandpool up` with authentication on (a multi-tenant api), a pool of 1, for one module."""
    try:
        up_help()
    except StackUnavailable as exc:
        pytest.skip(str(exc))
    s = Stack(free_port(), ["--pool-size", "1"], auth=True)
    try:
        s.start()
        yield s
    finally:
        s.stop()
        s.remove()
