"""`sandpool controller --provider kubernetes` and `sandpool api` end to end, against the real API server
and real agents.

Both run as real processes configured only by their flags: the controller with a
kubeconfig and the pools file (it creates, watches and deletes the pods), the api
with the same pools file and no Kubernetes credential at all. The stand-in kubelet
runs each pod's own command line, so the sessions below execute code in a real
`sandpool agent` that the api reaches at its pod IP. While the API server is down,
sessions are still leased and run: nothing on the request path calls the Kubernetes
API.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from realapi import RealCluster
from testkit import free_port, scrubbed_env, stop_group, wait_for, wait_http

POOLS = """
pools:
  - name: default
    image: python
    warm: 1
    ceiling: 4
    resources:
      limits: {cpu: 1, memory: 512Mi}
  - name: gvisor
    image: python-gvisor
    warm: 1
    ceiling: 2
    runtime_class: gvisor
"""


@pytest.fixture
def control_plane(cluster: RealCluster, namespace: str, kubelet: Any, tmp_path: Path, redis_url: str,
                  redis_prefix: str, agent_port: int) -> Iterator[dict[str, str]]:
    """The controller (the kubernetes provider) and the api (standalone), sharing Redis and the pools file."""
    cluster.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", ok=(201, 409),
                    body={"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "gvisor"},
                          "handler": "runsc"})
    (tmp_path / "pools.yaml").write_text(POOLS)
    shared = ["--redis-url", redis_url, "--redis-prefix", redis_prefix, "--pools-file", str(tmp_path / "pools.yaml")]
    commands = {
        "controller": ["controller", *shared, "--provider", "kubernetes",
                       "--kubeconfig", str(cluster.kubeconfig(tmp_path / "kc")), "--kube-namespace", namespace,
                       "--kube-installation", "e2e", "--kube-agent-port", str(agent_port),
                       "--kube-ready-timeout-seconds", "30", "--kube-backoff-max-seconds", "1"],
        # No kubeconfig, no service account: the api could not call the Kubernetes API if it tried.
        "api": ["api", *shared, "--no-auth"],
    }
    urls: dict[str, str] = {}
    with ExitStack() as stack:
        for name, command in commands.items():
            port = free_port()
            log_path = tmp_path / f"{name}.log"
            log = stack.enter_context(log_path.open("wb"))
            env = {k: v for k, v in scrubbed_env().items() if k != "KUBECONFIG"}
            proc = subprocess.Popen([sys.executable, "-m", "sandpool", *command, "--port", str(port)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            stack.callback(stop_group, proc)
            urls[name] = f"http://127.0.0.1:{port}"
            wait_http(urls[name] + "/readyz", proc=proc, log=log_path, timeout=30, what=f"{name} ready")
        yield urls


def ready_pods(cluster: RealCluster, namespace: str, pool: str) -> list[dict[str, Any]]:
    return [p for p in cluster.pods(namespace) if p["metadata"]["labels"]["sandpool.dev/pool"] == pool
            and not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


@pytest.mark.kubelet("agent")
def test_sessions_run_in_pods_and_survive_an_api_server_outage(
        control_plane: dict[str, str], cluster: RealCluster, namespace: str) -> None:
    with httpx.Client(base_url=control_plane["api"], timeout=30) as client, \
            httpx.Client(base_url=control_plane["controller"], timeout=30) as controller:
        def warm() -> bool:
            return bool(ready_pods(cluster, namespace, "default")) and bool(ready_pods(cluster, namespace, "gvisor"))

        wait_for(warm, what="one warm pod per pool")
        warm_pods = {p["metadata"]["name"] for p in cluster.pods(namespace)}
        assert len(warm_pods) == 2  # warm: 1 per pool, nothing more
        (gvisor_pod,) = ready_pods(cluster, namespace, "gvisor")
        assert gvisor_pod["spec"]["runtimeClassName"] == "gvisor"

        def leased(body: dict[str, Any]) -> dict[str, Any] | None:
            # Publication follows the agent's answer: give the controller its moment to publish.
            response = client.post("/sessions", json=body)
            return response.json() if response.status_code == 201 else None

        cluster.stop_apiserver()  # from now on there is no Kubernetes API: CreateSession must not care
        try:
            session = wait_for(lambda: leased({}), what="a lease")
            assert session["pool"] == "default"
            ran = client.post(f"/sessions/{session['session_id']}/exec",
                              json={"tool": "code_execution", "input": {"code": "print(6 * 7)"}})
            assert ran.status_code == 200, ran.text
            assert "42" in ran.text
            other = wait_for(lambda: leased({"image": "python-gvisor"}), what="a lease from the gvisor pool")
            assert other["pool"] == "gvisor"
            assert client.delete(f"/sessions/{session['session_id']}").status_code == 204
            assert client.delete(f"/sessions/{other['session_id']}").status_code == 204
        finally:
            cluster.start_apiserver()

        # Once the API server is back, the released sandboxes go and both pools are refilled.
        def replaced() -> bool:
            names = {p["metadata"]["name"] for p in cluster.pods(namespace)}
            return (len(ready_pods(cluster, namespace, "default")) == 1
                    and len(ready_pods(cluster, namespace, "gvisor")) == 1
                    and len(names) == 2 and not names & warm_pods)

        wait_for(replaced, what="used pods destroyed and both pools refilled")

        # What the provider saw is on the controller's /metrics, for rates and alerts. A sandbox counts
        # as created once its agent answers the provider, which may come a moment after the pod's
        # Ready condition that `replaced` read: scrape until it has.
        def scrape() -> dict[str, float]:
            return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                    for line in controller.get("/metrics").text.splitlines() if line.startswith("sandpool_kube_")}

        def counted() -> dict[str, float] | None:
            now = scrape()
            return now if (now.get('sandpool_kube_sandboxes_total{event="created"}', 0) >= 4
                           and now.get('sandpool_kube_sandboxes_total{event="destroyed"}', 0) >= 2) else None

        scraped = wait_for(counted, what="four sandboxes counted as created, two as destroyed", state=scrape)
        assert scraped['sandpool_kube_api_calls_total{operation="create_pod"}'] >= 4
        assert scraped['sandpool_kube_api_failures_total{kind="connection"}'] >= 1  # the outage, as seen
        assert scraped["sandpool_kube_watch_lists_total"] >= 1
        assert scraped["sandpool_kube_watched_pods"] >= 2
        # The split, as a scraper sees it: the api counted the execution it forwarded and has no
        # provider to report on; the controller's pool gauges show both pools.
        api_metrics = client.get("/metrics").text
        assert not [line for line in api_metrics.splitlines() if line.startswith("sandpool_kube_")]
        assert any(line.startswith("sandpool_executions_total{") and float(line.rsplit(" ", 1)[1]) >= 1
                   for line in api_metrics.splitlines())
        gauges = controller.get("/metrics").text
        assert 'sandpool_pool_ceiling{pool="default"} 4.0' in gauges
        assert 'sandpool_pool_ceiling{pool="gvisor"} 2.0' in gauges
