"""A real kube-apiserver with its own etcd, for the tests against a real API server.

The binary's path comes from `SANDPOOL_TEST_KUBE_APISERVER` (`.ci/run` decompresses
it once into a cache and sets the variable); etcd is Debian's `etcd-server`
(`etcd` on PATH, or `SANDPOOL_TEST_ETCD`). Without either the tests that need them
skip with a one-line reason.

`RealCluster` starts etcd, writes a CA, a serving certificate, a service-account key
pair and a static token file (one admin identity in `system:masters`), then starts
the API server with the flags its README lists and waits for `/readyz`.
`restart_apiserver()` stops and starts the API server alone (same etcd, port and
certificates): what a control-plane upgrade or crash looks like to a client.

Both are started with `testkit.tied_popen`: they get SIGKILL when the test process
dies, so a run killed by a signal (no teardown) leaves no etcd or API server behind
holding ports and memory. That holds for a restart from a worker thread too
(`asyncio.to_thread(cluster.restart_apiserver)`).

It is only the API server: no scheduler, controller-manager or kubelet. A
namespace's `default` ServiceAccount (made by a controller on a real cluster) is
created by `namespace()`; pods are bound and run by `kubelet.StandInKubelet`.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from testkit import free_port, tied_popen, wait_http

APISERVER_ENV = "SANDPOOL_TEST_KUBE_APISERVER"
ETCD_ENV = "SANDPOOL_TEST_ETCD"
START_TIMEOUT_SECONDS = 60.0
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
OPENSHIFT_CA_CONFIGMAP = "openshift-service-ca.crt"


class Unavailable(Exception):
    """The binaries are not here: the tests that need them skip with this reason."""


def binaries() -> tuple[str, str]:
    """(kube-apiserver, etcd), or `Unavailable` saying what is missing."""
    apiserver = os.environ.get(APISERVER_ENV, "")
    if not apiserver:
        raise Unavailable(f"{APISERVER_ENV} is not set (.ci/run sets it): no tests against a real API server")
    if not os.access(apiserver, os.X_OK):
        raise Unavailable(f"{APISERVER_ENV}={apiserver} is not an executable file")
    etcd = os.environ.get(ETCD_ENV) or shutil.which("etcd") or ""
    if not etcd:
        raise Unavailable("no etcd (Debian's etcd-server) on PATH and no SANDPOOL_TEST_ETCD: "
                          "no tests against a real API server")
    return apiserver, etcd


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def write_certificates(directory: Path) -> None:
    """ca.crt, server.crt/key (127.0.0.1, localhost, kubernetes.default), sa.key/pub."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sandpool-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False),
                         critical=True)
          .sign(ca_key, hashes.SHA256()))
    server_key = ec.generate_private_key(ec.SECP256R1())
    names = [x509.DNSName("localhost"), x509.DNSName("kubernetes.default.svc"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = (x509.CertificateBuilder()
              .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]))
              .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
              .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=2))
              .add_extension(x509.SubjectAlternativeName(names), critical=False)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .sign(ca_key, hashes.SHA256()))
    (directory / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "server.crt").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_key(directory / "server.key", server_key)
    sa_key = ec.generate_private_key(ec.SECP256R1())
    _write_key(directory / "sa.key", sa_key)
    (directory / "sa.pub").write_bytes(sa_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def _stop(proc: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RealCluster:
    def __init__(self, workdir: Path) -> None:
        self.apiserver_binary, self.etcd_binary = binaries()
        self.workdir = workdir
        self.certs = workdir / "pki"
        self.etcd_port = free_port()
        self.port = free_port()
        self.admin_token = secrets.token_urlsafe(24)
        self.etcd: subprocess.Popen[bytes] | None = None
        self.apiserver: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._client: httpx.Client | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.certs / "ca.crt"

    def ssl_context(self) -> ssl.SSLContext:
        """Verifies the API server against the test CA (for httpx clients)."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> RealCluster:
        try:
            self._start()
        except BaseException:
            self.stop()  # nothing of a failed start is left running
            raise
        return self

    def _start(self) -> None:
        self.certs.mkdir(parents=True)
        write_certificates(self.certs)
        (self.certs / "tokens.csv").write_text(f'{self.admin_token},sandpool-test-admin,{uuid.uuid4()},'
                                                f'"system:masters"\n')
        (self.certs / "tokens.csv").chmod(0o600)
        peer = free_port()
        self.etcd = tied_popen(
            [self.etcd_binary, "--name", "test", "--data-dir", str(self.workdir / "etcd"),
             "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"test=http://127.0.0.1:{peer}",
             "--unsafe-no-fsync", "--log-level", "error", "--logger", "zap"],
            stdout=subprocess.DEVNULL, stderr=(self.workdir / "etcd.log").open("ab"), start_new_session=True)
        wait_http(f"http://127.0.0.1:{self.etcd_port}/health", proc=self.etcd, log=self.log_tail,
                  timeout=START_TIMEOUT_SECONDS, interval=0.1, what="etcd")
        self.start_apiserver()

    def start_apiserver(self) -> None:
        c = self.certs
        log = (self.workdir / "apiserver.log").open("ab")
        self.apiserver = tied_popen(
            [self.apiserver_binary,
             f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
             "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
             f"--tls-cert-file={c / 'server.crt'}", f"--tls-private-key-file={c / 'server.key'}",
             f"--client-ca-file={c / 'ca.crt'}", f"--cert-dir={c}",
             f"--service-account-issuer={SA_ISSUER}", f"--service-account-key-file={c / 'sa.pub'}",
             f"--service-account-signing-key-file={c / 'sa.key'}",
             "--service-cluster-ip-range=10.96.0.0/24", f"--token-auth-file={c / 'tokens.csv'}",
             "--authorization-mode=RBAC", "--enable-priority-and-fairness=false",
             "--endpoint-reconciler-type=none", "--allow-privileged=true", "--profiling=false",
             "--v=0"],
            stdout=log, stderr=log, start_new_session=True)
        log.close()

        wait_http(self.url + "/readyz", proc=self.apiserver, log=self.log_tail, timeout=START_TIMEOUT_SECONDS,
                  interval=0.1, probe_timeout=2, what="kube-apiserver", verify=self.ssl_context(),
                  headers={"Authorization": f"Bearer {self.admin_token}"})

    def restart_apiserver(self, *, down_seconds: float = 0.0) -> None:
        """Stop the API server, wait, start it again (same etcd, port and certificates).

        SIGTERM first, as a rolling upgrade does: it stops listening at once and closes
        what is open. Its graceful drain then waits up to a minute for the streams it
        closed; after 2 s it is killed, which changes nothing a client can see."""
        self.stop_apiserver()
        time.sleep(down_seconds)
        self.start_apiserver()
        self.restarts += 1

    def stop_apiserver(self) -> None:
        """An API-server outage begins (`start_apiserver()` ends it)."""
        _stop(self.apiserver, grace=2)
        if self._client is not None:
            self._client.close()
            self._client = None

    def stop(self) -> None:
        self.stop_apiserver()
        _stop(self.etcd)

    def log_tail(self, chars: int = 3000) -> str:
        out = []
        for name in ("etcd.log", "apiserver.log"):
            path = self.workdir / name
            if path.exists():
                out.append(f"--- {name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    # --- access ---------------------------------------------------------------------------

    def kubeconfig(self, path: Path, *, token: str | None = None, namespace: str = "default") -> Path:
        """A kubeconfig for the admin identity (or the given bearer token), verifying the CA."""
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url,
                                                      "certificate-authority": str(self.ca_file)}}],
            "users": [{"name": "test", "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test",
                                                      "namespace": namespace}}],
        }
        path.write_text(json.dumps(config))
        path.chmod(0o600)
        return path

    @property
    def client(self) -> httpx.Client:
        """An admin HTTP client for setting tests up (namespaces, RBAC, reading state)."""
        if self._client is None:
            self._client = httpx.Client(base_url=self.url, verify=self.ssl_context(), timeout=10,
                                        headers={"Authorization": f"Bearer {self.admin_token}"})
        return self._client

    def request(self, method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None,
                ok: tuple[int, ...] = (200, 201, 202), **headers: str) -> dict[str, Any]:
        response = self.client.request(method, path, json=body, params=params, headers=headers or None)
        if response.status_code not in ok:
            raise AssertionError(f"{method} {path}: {response.status_code} {response.text[:500]}")
        return response.json() if response.content else {}

    def namespace(self, name: str, *, pod_security: str | None = "restricted") -> str:
        """A namespace (Pod Security `pod_security` enforced) with what a cluster's controllers add."""
        labels = {"pod-security.kubernetes.io/enforce": pod_security,
                  "pod-security.kubernetes.io/enforce-version": "latest"} if pod_security else {}
        self.request("POST", "/api/v1/namespaces", body={"metadata": {"name": name, "labels": labels}})
        # The serviceaccount controller makes `default`; ServiceAccount admission refuses pods without it.
        self.request("POST", f"/api/v1/namespaces/{name}/serviceaccounts", body={"metadata": {"name": "default"}})
        # This build's ServiceAccount admission projects this ConfigMap into token-mounting pods.
        self.request("POST", f"/api/v1/namespaces/{name}/configmaps",
                     body={"metadata": {"name": OPENSHIFT_CA_CONFIGMAP}, "data": {"service-ca.crt": ""}})
        return name

    def pods(self, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else None
        return list(self.request("GET", f"/api/v1/namespaces/{namespace}/pods", params=params)["items"])

    def secrets(self, namespace: str, selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": selector} if selector else None
        return list(self.request("GET", f"/api/v1/namespaces/{namespace}/secrets", params=params)["items"])

    def delete_pod(self, namespace: str, name: str, *, grace_seconds: int | None = None) -> None:
        """`kubectl delete pod` (the kubelet finishes it once the container stopped)."""
        body = {} if grace_seconds is None else {"gracePeriodSeconds": grace_seconds}
        self.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body=body, ok=(200, 202, 404))

    def service_account_token(self, namespace: str, name: str, *, seconds: int = 3600) -> str:
        """A bound token of a ServiceAccount (TokenRequest), as a pod running under it gets."""
        answer = self.request("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                              body={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                    "spec": {"expirationSeconds": seconds}})
        return str(answer["status"]["token"])
