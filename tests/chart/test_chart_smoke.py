"""The `helm test` pod's script, run against a real stack on loopback.

The chart's test pod (command, environment, the signing key it mounts) is taken
from the rendered manifest and pointed at a real api and controller (local
provider) started here over the test suite's redis-server, so what `helm test`
checks on a cluster is checked here without one: mint a token with the release's
signing key, create a session, run print(1), destroy it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chart_support import CHART, Helm, find, pod_spec, secret_value
from testkit import free_port, wait_http


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    wait_http(f"{url}/readyz", proc=proc, log=log, timeout=60, interval=0.1, what=url)


async def _destroy_sandboxes(data_dir: Path) -> None:
    from sandpool.providers import build_provider

    provider = build_provider("local", data_dir=data_dir)
    await provider.start()
    try:
        await provider.destroy_all()  # type: ignore[attr-defined]  # the local provider's own method
    finally:
        await provider.close()


def _sandpool() -> list[str]:
    return [sys.executable, "-m", "sandpool"]


@pytest.fixture(scope="module")
def release(helm: Helm) -> list[dict[str, Any]]:
    return helm.render()


@pytest.fixture(scope="module")
def stack(release: list[dict[str, Any]], redis_server: Any,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """api + controller (local provider, one warm sandbox), the api trusting the release's signing key."""
    work = tmp_path_factory.mktemp("stack")
    key = work / "signing" / "ed25519.key"
    key.parent.mkdir()
    key.write_text(secret_value(find(release, "Secret", "-signing"), "ed25519.key"))
    key.chmod(0o600)
    subprocess.run([*_sandpool(), "keygen", "--out", str(work / "other.key")], check=True, capture_output=True,
                   timeout=60)
    public = work / "signing.pub"
    from cryptography.hazmat.primitives import serialization

    from sandpool.edge.keys_cli import load_private_key
    public.write_bytes(load_private_key(key).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    prefix = f"chart{os.getpid()}"
    env = {**os.environ, "SANDPOOL_REDIS_URL": redis_server.url, "SANDPOOL_REDIS_PREFIX": prefix}
    controller_port, api_port = free_port(), free_port()
    # Agent sockets live under the data dir: keep its path short (sun_path is 108 bytes).
    data_dir = Path(tempfile.mkdtemp(prefix="spc-", dir="/tmp"))
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    try:
        pools = ("--pool-size", "1", "--max-sandboxes", "2")  # both read the same pools, as in the chart
        log = work / "controller.log"
        logs.append(log.open("wb"))
        procs.append(subprocess.Popen(
            [*_sandpool(), "controller", "--port", str(controller_port), "--provider", "local", *pools,
             "--data-dir", str(data_dir)],
            env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        _wait_ready(f"http://127.0.0.1:{controller_port}", procs[-1], log)
        log = work / "api.log"
        logs.append(log.open("wb"))
        procs.append(subprocess.Popen(
            [*_sandpool(), "api", "--port", str(api_port), "--auth-public-key", str(public), *pools],
            env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
        _wait_ready(f"http://127.0.0.1:{api_port}", procs[-1], log)
        yield {"url": f"http://127.0.0.1:{api_port}", "key": key, "other_key": work / "other.key", "work": work}
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for handle in logs:
            handle.close()
        # A stopped controller leaves its sandboxes for the next one to reconcile (by design):
        # destroy them with the provider itself, as `sandpool up` does on its way out.
        asyncio.run(_destroy_sandboxes(data_dir))
        shutil.rmtree(data_dir, ignore_errors=True)


def _run_test_pod(release: list[dict[str, Any]], stack: dict[str, Any], key: Path) -> subprocess.CompletedProcess[str]:
    """The rendered test pod's container, run here: its command, its env, its mounts mapped to files."""
    pod = find(release, "Pod", "-test")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    [container] = pod_spec(pod)["containers"]
    script_dir = stack["work"] / "smoke"
    script_dir.mkdir(exist_ok=True)
    script = find(release, "ConfigMap", "-test")["data"]["smoke_test.py"]
    assert script == (CHART / "files" / "smoke_test.py").read_text()
    (script_dir / "smoke_test.py").write_text(script)
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SMOKE_URL"] == "http://sp-sandpool-api:8080"
    assert env["SMOKE_KEY"] == "/etc/sandpool/signing/ed25519.key"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/etc/sandpool/signing"] == "signing" and mounts["/opt/smoke"] == "script"
    env.update(SMOKE_URL=stack["url"], SMOKE_KEY=str(key), SMOKE_TIMEOUT="60")
    command = [sys.executable if container["command"][0] == "python" else container["command"][0],
               *[c.replace("/opt/smoke", str(script_dir)) for c in container["command"][1:]]]
    return subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


def test_helm_test_pod_runs_a_session_end_to_end(release: list[dict[str, Any]], stack: dict[str, Any]) -> None:
    proc = _run_test_pod(release, stack, stack["key"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ran print(1) and was destroyed" in proc.stdout


def test_helm_test_pod_fails_loudly_with_an_untrusted_key(release: list[dict[str, Any]], stack: dict[str, Any]) -> None:
    proc = _run_test_pod(release, stack, stack["other_key"])
    assert proc.returncode == 1
    assert "smoke test FAILED: CreateSession answered 401" in proc.stderr
