"""Helpers of the tests on a real single-node cluster: helm, kubectl, the API, a session client.

The cluster is the one `.ci/cluster start` runs on this machine (the kubeconfig it prints is
`SANDPOOL_TEST_CLUSTER_KUBECONFIG`); `restart()` asks the same script to restart one of its
components by pid (the kubelet, the API server), which is what a crash or upgrade of it looks like
to sandpool.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "sandpool"
CLUSTER_SCRIPT = ROOT / ".ci" / "cluster"
KUBECONFIG_ENV = "SANDPOOL_TEST_CLUSTER_KUBECONFIG"
UNAVAILABLE_ENV = "SANDPOOL_TEST_CLUSTER_UNAVAILABLE"  # why not, when .ci/run could not start one
# Where .ci/cluster runs containerd (for killing a container the way a crash on the node does).
CONTAINERD_SOCKET = "/run/sandpool-containerd/containerd.sock"


def local_image(values_key: str) -> str:
    """The image .ci/images built for `image` or `sandboxImage`, as containerd names it (localhost/...)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return "localhost/" + values[values_key]["repository"]


@dataclass
class Cluster:
    kubeconfig: Path
    helm_binary: str
    kubectl_binary: str
    _env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def helm(self, *args: str, check: bool = True, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        return self._run([self.helm_binary, *args], check, timeout)

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self._run([self.kubectl_binary, *args], check, timeout)

    def _run(self, cmd: list[str], check: bool, timeout: float) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=self._env)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd[:3])} ... exited {proc.returncode}:\n{proc.stderr or proc.stdout}")
        return proc

    def get(self, *args: str) -> Any:
        """`kubectl get ... -o json`, parsed."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def pods(self, namespace: str, selector: str = "") -> list[dict[str, Any]]:
        args = ["pods", "-n", namespace] + (["-l", selector] if selector else [])
        return list(self.get(*args)["items"])

    def secret_value(self, namespace: str, name: str, key: str) -> bytes:
        """A Secret's entry, read as NOTES.txt says (`kubectl get secret -o jsonpath=...`, base64 -d)."""
        escaped = key.replace(".", "\\.")
        out = self.kubectl("-n", namespace, "get", "secret", name, "-o", f"jsonpath={{.data.{escaped}}}").stdout
        return base64.b64decode(out)

    def on_this_machine(self) -> None:
        """Skip unless this is .ci/cluster's own cluster (the faults below act on its processes)."""
        state = Path(os.environ.get("SANDPOOL_CLUSTER_DIR", "/run/sandpool-cluster"))
        if (self.kubeconfig.resolve() != (state / "admin.kubeconfig").resolve()
                or not os.path.exists(CONTAINERD_SOCKET) or shutil.which("ctr") is None):
            pytest.skip(f"{self.kubeconfig} is not .ci/cluster's cluster: its node's processes are not ours to kill")

    def restart(self, component: str) -> None:
        self.on_this_machine()
        proc = subprocess.run([sys.executable, str(CLUSTER_SCRIPT), "restart", component], capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, f".ci/cluster restart {component} failed:\n{proc.stderr}"

    def kill_container(self, container_id: str) -> None:
        """SIGKILL a container's processes on the node, as a crash there would (the kubelet sees it die)."""
        self.on_this_machine()
        subprocess.run(["ctr", "--address", CONTAINERD_SOCKET, "-n", "k8s.io", "tasks", "kill", "-a", "-s",
                        "SIGKILL", container_id], check=True, capture_output=True, timeout=30)


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return (pod.get("metadata", {}).get("deletionTimestamp") is None
            and any(c["type"] == "Ready" and c["status"] == "True" for c in conditions))


def restarts(pod: dict[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in pod.get("status", {}).get("containerStatuses") or [])


@dataclass
class Sessions:
    """The contract's operations over HTTP with a bearer token (what any v1 client sends)."""

    base_url: str
    token: str

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.token}"},
                            timeout=timeout)

    def create(self, http: httpx.Client) -> dict[str, Any]:
        answer = http.post("/sessions", json={})
        assert answer.status_code in (200, 201), answer.text
        return dict(answer.json())

    @staticmethod
    def run(http: httpx.Client, session_id: str, code: str, tool: str = "code_execution") -> httpx.Response:
        field_name = "command" if tool == "bash_code_execution" else "code"
        return http.post(f"/sessions/{session_id}/exec", json={"tool": tool, "input": {field_name: code}})

    @classmethod
    def content(cls, http: httpx.Client, session_id: str, code: str, tool: str = "code_execution") -> dict[str, Any]:
        answer = cls.run(http, session_id, code, tool)
        assert answer.status_code == 200, answer.text
        return dict(answer.json()["result_block"]["content"])

    @classmethod
    def pod_of(cls, http: httpx.Client, session_id: str) -> str:
        """The pod serving a session: its hostname, as the sandboxed code sees it."""
        out = cls.content(http, session_id, "import socket; print(socket.gethostname())")
        return str(out["stdout"]).strip()
