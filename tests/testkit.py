"""Helpers every test directory shares: free ports, polling, and the external tools CI installs.

A test never installs anything: `.ci/run` installs helm, checkov and the Kubernetes
API server and names them in `SANDPOOL_TEST_*` variables; without one, the tests that
need it skip with a one-line reason saying how to get it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

TOOLS = {
    "helm": ("SANDPOOL_TEST_HELM", ".ci/install-helm"),
    "kubectl": ("SANDPOOL_TEST_KUBECTL", ".ci/install-helm"),
    "checkov": ("SANDPOOL_TEST_CHECKOV", ".ci/install-checkov"),
    "kube-apiserver": ("SANDPOOL_TEST_KUBE_APISERVER", ".ci/install-kube-apiserver"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.05, what: str = "") -> T:
    """Poll until `predicate()` is truthy and return it; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


async def eventually(check: Callable[[], Awaitable[Any]], *, timeout: float = 30.0, interval: float = 0.05,
                     what: str = "") -> Any:
    """The asyncio `wait_for`: await `check()` until it is truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        await asyncio.sleep(interval)


def injected_headers(credential: str, workspace: str, **limits: int) -> dict[str, str]:
    """What the proxy sends the scheduler: its credential, the workspace, and every limit the catalogue
    forwards (`limits` by name; the rest 0: none of the workspace's own)."""
    from sandpool.contract import limits as catalogue
    from sandpool.contract import tenancy

    headers = {"Authorization": f"Bearer {credential}", tenancy.WORKSPACE: workspace}
    for limit in catalogue.forwarded():
        assert limit.header is not None
        headers[limit.header] = str(limits.get(limit.name, limit.unset))
    return headers


def tool(name: str) -> str:
    """The path of an external tool CI installed, or a skip saying how to get it (never an install)."""
    variable, installer = TOOLS[name]
    path = os.environ.get(variable) or shutil.which(name)
    if not path or not os.access(path, os.X_OK):
        pytest.skip(f"{name} unavailable: set {variable} (`.ci/run` installs it with {installer})")
    return path
