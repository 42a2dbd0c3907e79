"""Fixtures: the stand-in API server (tests/kubernetes/apiserver.py) and providers pointed at it.

The provider under test is the real one, using the real `kubernetes` client over
HTTP, configured from a kubeconfig file the stand-in writes. On failure the
stand-in's pods (with their status) are printed, like a cluster test would.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from apiserver import StandInApiServer  # noqa: E402

from sandpool.providers.kubernetes import KubernetesProvider, KubernetesProviderSettings  # noqa: E402

NAMESPACE = "sandboxes"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "standin(**options): options of the stand-in API server of a test")


@pytest.fixture
def apiserver(request: pytest.FixtureRequest) -> Iterator[StandInApiServer]:
    marker = request.node.get_closest_marker("standin")
    options: dict[str, Any] = dict(marker.kwargs) if marker else {}
    server = StandInApiServer(**options).start()
    yield server
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        for pod in server.pods():
            print("pod", json.dumps({"name": pod["metadata"]["name"], "status": pod.get("status")}))
    server.stop()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]


@pytest.fixture
def agent_port() -> int:
    return free_port()


@pytest.fixture
def make_settings(apiserver: StandInApiServer, tmp_path: Path, agent_port: int
                  ) -> Callable[..., KubernetesProviderSettings]:
    kubeconfig = apiserver.kubeconfig(tmp_path / "kubeconfig")

    def make(**overrides: Any) -> KubernetesProviderSettings:
        values: dict[str, Any] = dict(
            kubeconfig=kubeconfig, kube_namespace=NAMESPACE, kube_installation="test",
            kube_agent_port=agent_port, kube_ready_timeout_seconds=30, kube_backoff_max_seconds=0.5,
            kube_api_timeout_seconds=5, kube_watch_timeout_seconds=30, kube_create_rate=100,
            kube_create_burst=50, kube_delete_rate=100, kube_delete_burst=50,
        )
        values.update(overrides)
        return KubernetesProviderSettings(**values)

    return make


@pytest.fixture
async def make_provider(make_settings: Callable[..., KubernetesProviderSettings]
                        ) -> AsyncIterator[Callable[..., Any]]:
    started: list[KubernetesProvider] = []

    async def make(**overrides: Any) -> KubernetesProvider:
        provider = KubernetesProvider(make_settings(**overrides))
        await provider.start()
        started.append(provider)
        return provider

    yield make
    for provider in started:
        await provider.close()


@pytest.fixture
async def provider(make_provider: Callable[..., Any]) -> KubernetesProvider:
    return await make_provider()
