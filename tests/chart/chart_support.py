"""Helpers of the chart tests: rendering with helm, picking objects, a fake API server."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "sandpool"
SCENARIOS = sorted(p.name for p in (CHART / "ci").glob("*.yaml"))
RELEASE = "sp"
NAMESPACE = "sandpool"


class HelmError(Exception):
    """`helm` exited non-zero; the message is its stderr."""


@dataclass
class Helm:
    binary: str
    _cache: dict[tuple[Any, ...], list[dict[str, Any]]] = field(default_factory=dict)

    def run(self, *args: str, env: dict[str, str] | None = None,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=60, env=env)
        if check and proc.returncode != 0:
            raise HelmError(proc.stderr.strip() or proc.stdout.strip())
        return proc

    def template_text(self, *values: str, sets: tuple[str, ...] = (), chart: Path = CHART,
                      extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
        args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE]
        for v in values:
            args += ["-f", str(v if Path(v).is_absolute() else CHART / "ci" / v)]
        for s in sets:
            args += ["--set", s]
        return self.run(*args, *extra, env=env).stdout

    def render(self, *values: str, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """The rendered objects (cached: treat them as read-only)."""
        key = (values, sets)
        if key not in self._cache:
            self._cache[key] = parse(self.template_text(*values, sets=sets))
        return self._cache[key]


def parse(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def find(objs: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] == "Pod":
        return obj["spec"]
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        return obj["spec"]["template"]["spec"]
    return None


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj) or {}
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def secret_value(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


class FakeApiServer:
    """Just enough of the Kubernetes API for helm's `lookup` of Secrets (loopback only).

    `helm template --dry-run=server` asks /api/v1 discovery and then GETs each
    Secret the templates look up; the tests preload what "the cluster" holds.
    """

    def __init__(self) -> None:
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                outer.requests.append(self.path)

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # the http.server spelling
                path = self.path.split("?")[0]
                if path == "/version":
                    return self._send(200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0"})
                if path == "/api":
                    return self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
                if path == "/apis":
                    return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": []})
                if path == "/api/v1":
                    return self._send(200, {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
                        {"name": "secrets", "singularName": "secret", "namespaced": True, "kind": "Secret",
                         "verbs": ["get", "list"]}]})
                parts = path.strip("/").split("/")
                if len(parts) == 6 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "secrets":
                    found = outer.secrets.get((parts[3], parts[5]))
                    if found is not None:
                        return self._send(200, found)
                return self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                        "reason": "NotFound", "code": 404})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.server.server_port}"}}],
            "users": [{"name": "u", "user": {"token": "fake"}}],
            "contexts": [{"name": "c", "context": {"cluster": "fake", "user": "u"}}],
            "current-context": "c",
        }))
        path.chmod(0o600)
        return path

    def hold(self, objs: list[dict[str, Any]]) -> None:
        """Store the rendered Secrets as if `helm install` had created them."""
        for obj in objs:
            if obj["kind"] == "Secret":
                self.secrets[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
