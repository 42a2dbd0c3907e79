"""`sandpool proxy` as a real process: HTTPS when given a certificate, the internal credential from a file."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from testkit import free_port, scrubbed_env, wait_http

from .conftest import INTERNAL_TOKEN, Echo, Keys


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


@pytest.fixture
def tls_proxy(tmp_path: Path, keys: Keys, echo: Echo, redis_url: str,
              redis_prefix: str) -> Iterator[tuple[str, Path]]:
    cert, key = self_signed(tmp_path)
    token_file = tmp_path / "internal-token"
    token_file.write_text(INTERNAL_TOKEN + "\n")
    port = free_port()
    log = tmp_path / "proxy.log"
    env = scrubbed_env()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandpool", "proxy", "--port", str(port), "--tls-cert", str(cert),
             "--tls-key", str(key), "--auth-public-key", str(keys.public), "--scheduler-url", echo.url,
             "--redis-url", redis_url, "--redis-prefix", redis_prefix, "--internal-token-file", str(token_file)],
            stdout=out, stderr=out, env=env)
    url = f"https://127.0.0.1:{port}"
    try:
        wait_http(url + "/healthz", proc=proc, log=log, timeout=30, what="the proxy",
                  verify=ssl.create_default_context(cafile=str(cert)))
        yield url, cert
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert INTERNAL_TOKEN not in log.read_text()  # the credential never reaches the logs


def test_https_proxy_forwards_with_the_credential_from_its_file(tls_proxy: tuple[str, Path], keys: Keys,
                                                                 echo: Echo) -> None:
    url, cert = tls_proxy
    with httpx.Client(base_url=url, verify=ssl.create_default_context(cafile=str(cert)), timeout=30,
                      headers={"Authorization": f"Bearer {keys.token()}", "X-Request-Id": "tls-1"}) as client:
        response = client.post("/sessions", json={})
        refused = client.post("/sessions", json={}, headers={"Authorization": "Bearer x.y.z"})
    assert response.status_code == 201 and response.headers["x-request-id"] == "tls-1"
    assert refused.status_code == 401
    assert [s.header("authorization") for s in echo.seen] == [[f"Bearer {INTERNAL_TOKEN}"]]
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served on the TLS port
        httpx.get(url.replace("https://", "http://") + "/healthz", timeout=2)
