"""Fixtures: a real API server (with a stand-in kubelet), and the stand-in API server.

Most tests here run the real provider, through the real `kubernetes` client, against
a real kube-apiserver and etcd started once per test session (`realapi.py`; skipped,
with the reason, when `SANDPOOL_TEST_KUBE_APISERVER` is not set), each test in a
namespace of its own that enforces Pod Security `restricted`. Pods are bound and
run by `kubelet.StandInKubelet` (mode chosen with `@pytest.mark.kubelet("agent")`;
`stub` by default).

The stand-in API server (`apiserver.py`) is kept only for what a real one cannot be
made to do on demand: answer 429 with `Retry-After`, fail with an injected 5xx, or
lose an answer after doing the work (`@pytest.mark.standin(**options)`).

On failure the test's pods (with their status) are printed, like a cluster test would.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from apiserver import StandInApiServer
from kubelet import StandInKubelet
from realapi import RealCluster, Unavailable, binaries
from testkit import free_port

from sandpool.providers.kubernetes import KubernetesProvider, KubernetesProviderSettings

STANDIN_NAMESPACE = "sandboxes"
INSTALLATION = "test"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "standin(**options): options of the stand-in API server of a test")
    config.addinivalue_line("markers", "kubelet(mode): what the stand-in kubelet runs: stub (default), agent, none")


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]  # pytest's recipe: the report kept on the item


def _failed(request: pytest.FixtureRequest) -> bool:
    report = getattr(request.node, "rep_call", None)
    return report is not None and report.failed


def base_settings(kubeconfig: Path, namespace: str, agent_port: int) -> dict[str, Any]:
    """Provider settings for tests: quick retries and timeouts, a limiter that does not get in the way."""
    return dict(kubeconfig=kubeconfig, kube_namespace=namespace, kube_installation=INSTALLATION,
                kube_agent_port=agent_port, kube_ready_timeout_seconds=30, kube_backoff_max_seconds=0.5,
                kube_api_timeout_seconds=5, kube_watch_timeout_seconds=30, kube_create_rate=100,
                kube_create_burst=50, kube_delete_rate=100, kube_delete_burst=50)


@pytest.fixture
def agent_port() -> int:
    return free_port()


# --- the real API server --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    try:
        binaries()
    except Unavailable as exc:
        pytest.skip(str(exc))
    real = RealCluster(tmp_path_factory.mktemp("kube")).start()
    yield real
    real.stop()


@pytest.fixture
def namespace(cluster: RealCluster) -> str:
    """A namespace of the test's own (namespaces never finish deleting without a controller-manager)."""
    return cluster.namespace(f"t-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def kubelet(cluster: RealCluster, namespace: str, request: pytest.FixtureRequest) -> Iterator[StandInKubelet]:
    marker = request.node.get_closest_marker("kubelet")
    mode = marker.args[0] if marker else "stub"
    node = StandInKubelet(cluster, namespace, mode=mode).start()
    yield node
    if _failed(request):
        for pod in cluster.pods(namespace):
            name = pod["metadata"]["name"]
            print("pod", json.dumps({"name": name, "deleting": pod["metadata"].get("deletionTimestamp"),
                                     "status": pod.get("status")}))
            if node.logs(name):
                print("log", name, node.logs(name)[-2000:])
    node.stop()


@pytest.fixture
def make_settings(cluster: RealCluster, namespace: str, tmp_path: Path, agent_port: int
                  ) -> Callable[..., KubernetesProviderSettings]:
    kubeconfig = cluster.kubeconfig(tmp_path / "kubeconfig")

    def make(**overrides: Any) -> KubernetesProviderSettings:
        return KubernetesProviderSettings(**{**base_settings(kubeconfig, namespace, agent_port), **overrides})

    return make


@pytest.fixture
async def make_provider(make_settings: Callable[..., KubernetesProviderSettings], kubelet: StandInKubelet
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


# --- the stand-in API server (429s, injected 5xx, lost answers) ------------------------------------


@pytest.fixture
def standin(request: pytest.FixtureRequest) -> Iterator[StandInApiServer]:
    marker = request.node.get_closest_marker("standin")
    options: dict[str, Any] = dict(marker.kwargs) if marker else {}
    server = StandInApiServer(**options).start()
    yield server
    if _failed(request):
        for pod in server.pods():
            print("pod", json.dumps({"name": pod["metadata"]["name"], "status": pod.get("status")}))
    server.stop()


@pytest.fixture
async def make_standin_provider(standin: StandInApiServer, tmp_path: Path, agent_port: int
                                ) -> AsyncIterator[Callable[..., Any]]:
    kubeconfig = standin.kubeconfig(tmp_path / "kubeconfig")
    started: list[KubernetesProvider] = []

    async def make(**overrides: Any) -> KubernetesProvider:
        settings = {**base_settings(kubeconfig, STANDIN_NAMESPACE, agent_port), **overrides}
        provider = KubernetesProvider(KubernetesProviderSettings(**settings))
        await provider.start()
        started.append(provider)
        return provider

    yield make
    for provider in started:
        await provider.close()
