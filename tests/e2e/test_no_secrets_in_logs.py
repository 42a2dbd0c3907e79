"""No secret in any log line, and a clean SIGTERM is status 0.

A password and a token are planted everywhere a service takes a credential: the
Redis URL (a real `redis-server` requiring that password), a presented bearer
token, a JWKS URL's userinfo, a kubeconfig's token and server URL. Each
service is started, made to log its configuration and its errors (an unreachable
JWKS document, an unreachable Redis, a cluster that cannot be reached), stopped
with SIGTERM, and every line it wrote is searched for both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from testkit import RedisServer, free_port, scrubbed_env, wait_http
from up_harness import Up, assert_stopped_clean

from sandpool.edge.keys_cli import generate_keypair, public_key_path

PASSWORD = f"planted-password-{uuid.uuid4().hex}"
TOKEN = f"planted-token-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server that requires the planted password; its URL carries it."""
    server = RedisServer(tmp_path_factory.mktemp("locked-redis"), "--requirepass", PASSWORD)
    server.start()
    yield f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
    server.stop()


def service_env(**values: str) -> dict[str, str]:
    return scrubbed_env(**{f"SANDPOOL_{k.upper()}": v for k, v in values.items()})


def run_until_ready(argv: list[str], env: dict[str, str], log: Path, url: str, *, path: str = "/readyz"
                    ) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "sandpool", *argv], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    wait_http(url + path, proc=proc, log=log, timeout=30, what=argv[0])
    return proc


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def assert_no_secret(text: str, *secrets: str) -> list[dict[str, object]]:
    for secret in (PASSWORD, TOKEN, *secrets):
        assert secret not in text, f"a secret was logged: {[line for line in text.splitlines() if secret in line]}"
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_controller_logs_no_secret_and_exits_zero_on_sigterm(locked_redis: str, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "controller.log"
    env = service_env(redis_url=locked_redis)
    data_dir = Path(tempfile.mkdtemp(prefix="sps", dir="/tmp"))  # (sandbox uids must reach it: not under tmp_path)
    data_dir.chmod(0o711)
    try:
        proc = run_until_ready(["controller", "--port", str(port), "--data-dir", str(data_dir), "--launcher",
                                "subprocess", "--pool-size", "0", "--log-level", "debug"], env, log,
                               f"http://127.0.0.1:{port}")
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 200
        assert stop(proc) == 0  # a clean shutdown on SIGTERM is a success, not 143
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    lines = assert_no_secret(log.read_text())
    (start,) = [line for line in lines if line["msg"] == "starting controller"]
    settings = json.loads(str(start["settings"]))
    assert settings["redis_url"].startswith("redis://***@127.0.0.1:")  # still says where Redis is


def test_api_logs_no_secret_and_exits_zero_on_sigterm(locked_redis: str, tmp_path: Path) -> None:
    private, _ = generate_keypair(tmp_path / "key.pem")
    port = free_port()
    log = tmp_path / "api.log"
    # A JWKS URL with credentials that cannot be fetched: its failure is logged with its location.
    jwks = f"https://jwks-reader:{TOKEN}@127.0.0.1:{free_port()}/jwks.json"
    env = service_env(redis_url=locked_redis, auth_jwks=jwks, auth_public_keys=str(public_key_path(private)))
    proc = run_until_ready(["api", "--port", str(port), "--log-level", "debug"], env, log, f"http://127.0.0.1:{port}")
    # A presented credential that is refused is not logged either.
    refused = httpx.post(f"http://127.0.0.1:{port}/sessions", json={}, headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=30)
    assert refused.status_code == 401
    assert stop(proc) == 0
    lines = assert_no_secret(log.read_text())
    assert any(line.get("jwks") == f"https://***@127.0.0.1:{jwks.rsplit(':', 1)[1]}" for line in lines), lines
    (start,) = [line for line in lines if line["msg"] == "configuration"]
    assert json.loads(str(start["settings"]))["redis_url"].startswith("redis://***@")


def test_errors_of_an_unreachable_redis_and_cluster_log_no_secret(tmp_path: Path) -> None:
    """The controller's error paths: Redis refuses, and the Kubernetes provider cannot start."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": f"https://admin:{PASSWORD}@127.0.0.1:{free_port()}",
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": TOKEN}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}]}))
    (tmp_path / "pools.yaml").write_text("pools:\n  - name: default\n    image: python\n")
    log = tmp_path / "controller.log"
    env = service_env(redis_url=f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0")
    with log.open("wb") as out:
        code = subprocess.run(
            [sys.executable, "-m", "sandpool", "controller", "--port", str(free_port()), "--provider", "kubernetes",
             "--pools-file", str(tmp_path / "pools.yaml"), "--kubeconfig", str(kubeconfig),
             "--kube-max-retries", "0", "--kube-api-timeout-seconds", "1", "--log-level", "debug"],
            env=env, stdout=out, stderr=subprocess.STDOUT, timeout=60).returncode
    text = log.read_text()
    assert code != 0 and "kubernetes provider cannot start" in text, text[-3000:]
    assert_no_secret(text)


def test_an_api_with_an_unreachable_redis_logs_no_secret(tmp_path: Path) -> None:
    """The api's error path: Redis refuses every call (a 503 to the client, a warning in the log)."""
    port = free_port()
    log = tmp_path / "api.log"
    env = service_env(redis_url=f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0", redis_timeout_seconds="1")
    proc = run_until_ready(["api", "--port", str(port), "--no-auth", "--log-level", "debug"], env, log,
                           f"http://127.0.0.1:{port}", path="/healthz")  # (no Redis: never ready)
    answer = httpx.post(f"http://127.0.0.1:{port}/sessions", json={}, timeout=30)
    assert answer.status_code == 503 and answer.json()["reason"] == "redis_unavailable", answer.text
    assert stop(proc) == 0
    text = log.read_text()
    assert "redis" in text.lower(), text[-3000:]
    assert_no_secret(text)


def test_sandpool_up_logs_no_secret(locked_redis: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`sandpool up` with a Redis of the operator's (by environment): its log, and its children's,
    carry neither that password nor the credential it makes itself (the dev token it prints on stdout)."""
    monkeypatch.setenv("SANDPOOL_REDIS_URL", locked_redis)
    up = Up("--pool-size", "1", "--log-level", "debug")
    try:
        up.printed("SANDPOOL_URL=")
        dev_token = up.printed("SANDPOOL_TOKEN=")
        assert_stopped_clean(up)
        log = up.data_dir.parent / f"{up.data_dir.name}.log"
        lines = assert_no_secret(log.read_text(errors="replace"), dev_token)
        assert {"api", "controller"} <= {line.get("service") for line in lines}  # the children's lines are here too
    finally:
        up.cleanup()
