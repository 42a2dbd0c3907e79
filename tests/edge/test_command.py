"""`sandpool api` as a real process: HTTPS when given a certificate, a Unix socket, one-line start failures,
and --help listing its settings (and none of the retired topology's)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import shutil
import socket
import ssl
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from testkit import free_port, scrubbed_env, wait_for, wait_http

from .conftest import Keys
from .stack import Sandboxes


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def api(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sandpool", "api", *args], capture_output=True, text=True,
                          timeout=timeout, env=scrubbed_env())


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.terminate()
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture
def tls_api(tmp_path: Path, keys: Keys, redis_url: str, redis_prefix: str) -> Iterator[tuple[str, Path]]:
    cert, key = self_signed(tmp_path)
    port = free_port()
    log = tmp_path / "api.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandpool", "api", "--port", str(port), "--tls-cert", str(cert),
             "--tls-key", str(key), "--auth-public-key", str(keys.public), "--capacity-wait-seconds", "0",
             "--redis-url", redis_url, "--redis-prefix", redis_prefix],
            stdout=out, stderr=out, env=scrubbed_env())
    url = f"https://127.0.0.1:{port}"
    try:
        wait_http(url + "/readyz", proc=proc, log=log, timeout=30, what="the api",
                  verify=ssl.create_default_context(cafile=str(cert)))
        yield url, cert
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]  # a clean stop on SIGTERM


def test_https_api_serves_the_contract_and_refuses_bad_tokens(tls_api: tuple[str, Path], keys: Keys,
                                                               sandboxes: Sandboxes) -> None:
    url, cert = tls_api
    sandboxes.publish()
    with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=str(cert)), timeout=30,
                      headers={"Authorization": f"Bearer {keys.token()}", "X-Request-Id": "tls-1"}) as client:
        response = client.post("/sessions", json={})
        refused = client.post("/sessions", json={}, headers={"Authorization": "Bearer x.y.z"})
    assert response.status_code == 201 and response.headers["x-request-id"] == "tls-1"
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert sandboxes.ready() == 0
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the TLS port
        httpx.get(url.replace("https://", "http://") + "/healthz", timeout=2)


def test_standalone_api_on_a_unix_socket(redis_url: str, redis_prefix: str, tmp_path: Path) -> None:
    directory = Path(tempfile.mkdtemp(prefix="spa", dir="/tmp"))  # short: sun_path is 108 bytes
    sock = directory / "api.sock"
    log = tmp_path / "api.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandpool", "api", "--no-auth", "--unix-socket", str(sock),
             "--redis-url", redis_url, "--redis-prefix", redis_prefix],
            stdout=out, stderr=out, env=scrubbed_env())
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://api", timeout=5) as client:
            def ready() -> bool:
                assert proc.poll() is None, log.read_text()[-3000:]
                try:
                    return client.get("/readyz").status_code == 200
                except httpx.TransportError:
                    return False

            wait_for(ready, timeout=30, what="the api on its socket")
            assert stat.S_IMODE(sock.stat().st_mode) == 0o600
            assert client.get("/readyz").json() == {"status": "ready", "checks": {"redis": "ok"}}
            assert client.get("/v1/usage").status_code == 404  # standalone: no admin API
    finally:
        status = stop(proc)
        removed = not sock.exists()  # the socket goes with the process
        shutil.rmtree(directory, ignore_errors=True)
    assert status == 0 and removed, log.read_text()[-3000:]


def test_start_failures_are_one_line_naming_what_to_change(keys: Keys, tmp_path: Path, redis_url: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        failure = tmp_path / "failure"
        taken = api("--no-auth", "--port", str(port), "--redis-url", redis_url, "--start-failure-file", str(failure))
    assert taken.returncode == 2
    assert taken.stderr.strip().splitlines()[-1] == f"sandpool api: port {port} is in use (choose another with --port)"
    assert failure.read_text() == f"port {port} is in use (choose another with --port)\n"
    missing = api("--auth-public-key", str(tmp_path / "missing.pem"), "--port", str(free_port()))
    assert missing.returncode == 2
    [line] = [line for line in missing.stderr.splitlines() if line.startswith("sandpool api:")]
    assert "cannot read" in line and "missing.pem" in line


def test_help_lists_the_api_settings_and_none_of_the_retired_ones() -> None:
    shown = api("--help", timeout=30)
    assert shown.returncode == 0
    for flag in ("--no-auth", "--auth-public-key", "--auth-jwks", "--auth-algorithms", "--redis-url",
                 "--capacity-wait-seconds", "--max-body-bytes", "--ceiling-requests-per-minute", "--unix-socket",
                 "--tls-cert", "--pool-size", "--max-sandboxes"):
        assert flag in shown.stdout, flag
    for flag in ("--scheduler-url", "--internal-token", "--standalone", "--controller", "--reap-interval-seconds",
                 "--data-dir", "--provider"):
        assert flag not in shown.stdout, flag
