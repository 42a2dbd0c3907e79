"""`sandpool scheduler --provider kubernetes` end to end, against the stand-in and real agents.

The scheduler runs as a real process configured only by its flags (kubeconfig,
pools file); the stand-in's kubelet runs each pod's own command line, so the
sessions below execute code in a real `sandpool agent` reached at its pod IP.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from apiserver import StandInApiServer

NS = "sandboxes"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

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


def wait(check: Any, *, timeout: float = 30.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def scheduler(apiserver: StandInApiServer, tmp_path: Path, redis_url: str, redis_prefix: str,
              agent_port: int) -> Iterator[str]:
    (tmp_path / "pools.yaml").write_text(POOLS)
    port = free_port()
    log = (tmp_path / "scheduler.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SANDPOOL_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandpool", "scheduler", "--standalone", "--port", str(port),
         "--redis-url", redis_url, "--redis-prefix", redis_prefix, "--provider", "kubernetes",
         "--pools-file", str(tmp_path / "pools.yaml"), "--kubeconfig", str(apiserver.kubeconfig(tmp_path / "kc")),
         "--kube-namespace", NS, "--kube-installation", "e2e", "--kube-agent-port", str(agent_port),
         "--kube-ready-timeout-seconds", "30"],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"scheduler exited: {(tmp_path / 'scheduler.log').read_text()[-3000:]}")
            try:
                return httpx.get(url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait(ready, what="scheduler ready")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def ready_pods(apiserver: StandInApiServer, pool: str) -> list[dict[str, Any]]:
    return [p for p in apiserver.pods(NS) if p["metadata"]["labels"]["sandpool.dev/pool"] == pool
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


@pytest.mark.standin(kubelet="agent")
def test_sessions_run_in_pods_and_create_session_needs_no_kubernetes_api(
        scheduler: str, apiserver: StandInApiServer) -> None:
    with httpx.Client(base_url=scheduler, timeout=30) as client:
        def warm() -> bool:
            return bool(ready_pods(apiserver, "default")) and bool(ready_pods(apiserver, "gvisor"))

        wait(warm, what="one warm pod per pool")
        warm_pods = {p["metadata"]["name"] for p in apiserver.pods(NS)}
        assert len(warm_pods) == 2  # warm: 1 per pool, nothing more
        # Publication happens after the agent answered; give the controller its moment to publish.
        def leased() -> httpx.Response | None:
            response = client.post("/sessions", json={})
            return response if response.status_code == 201 else None

        # From now on the API server fails every request: CreateSession must not care.
        apiserver.inject("*", "*", 503, times=10_000)
        session = wait(leased, what="a lease").json()
        assert session["pool"] == "default"
        ran = client.post(f"/sessions/{session['session_id']}/exec",
                          json={"tool": "code_execution", "input": {"code": "print(6 * 7)"}})
        assert ran.status_code == 200, ran.text
        assert "42" in ran.text

        other = client.post("/sessions", json={"image": "python-gvisor"})
        assert other.status_code == 201, other.text
        assert other.json()["pool"] == "gvisor"
        (gvisor_pod,) = [p for p in apiserver.pods(NS) if p["metadata"]["labels"]["sandpool.dev/pool"] == "gvisor"]
        assert gvisor_pod["spec"]["runtimeClassName"] == "gvisor"
        assert {p["metadata"]["name"] for p in apiserver.pods(NS)} == warm_pods  # no create got through
        apiserver.call(apiserver.faults.clear)

        # Released sandboxes are destroyed: their pods go; the pools are refilled.
        leased_ids = {session["session_id"], other.json()["session_id"]}
        for sid in leased_ids:
            assert client.delete(f"/sessions/{sid}").status_code == 204

        def replaced() -> bool:
            names = {p["metadata"]["name"] for p in apiserver.pods(NS)}
            return (len(ready_pods(apiserver, "default")) == 1 and len(ready_pods(apiserver, "gvisor")) == 1
                    and len(names) == 2 and not names & warm_pods)

        wait(replaced, what="used pods destroyed and both pools refilled")
