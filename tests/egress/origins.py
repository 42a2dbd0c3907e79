"""Stand-ins for the outside world, on loopback: HTTPS and HTTP origins, and a tap that counts wire bytes.

- `Origin`: a real `http.server` (TLS when given a certificate) serving
  `/bytes/N` (N bytes), `/echo` (what it received: body length and a hash;
  Content-Length or chunked), fixed files (a package index for pip) and fixed
  redirects (302 to a given Location); it records every request (method, path, headers, body length).
- `Tap`: a counting TCP relay in front of an origin. The egress proxy connects
  to the tap, so the tap's counts are exactly the bytes the proxy sent to and
  received from the outside, TLS records included: what metering must match.
- `Certificate`: one self-signed certificate for every test name (and
  127.0.0.1), so a handshake for another name than the tunnel's would succeed
  if the proxy let it through.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import ipaddress
import json
import socket
import socketserver
import ssl
import threading
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

TEST_NAMES = ("files.example.test", "other.example.test", "pypi.example.test", "deep.cdn.example.test")


@dataclass(frozen=True)
class Certificate:
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))


def make_certificate(directory: Path) -> Certificate:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sandpool egress test origin")])
    now = dt.datetime.now(dt.UTC)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in TEST_NAMES]
    sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    public = key.public_key()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=2))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(public), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "origin.crt", directory / "origin.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return Certificate(cert_path, key_path)


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body_length: int


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _OriginServer

    def log_message(self, format: str, *args: Any) -> None:  # the base class's name
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes, content_type: str = "application/octet-stream") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        body = self._body() if self.command in ("POST", "PUT") else b""
        self.server.origin.seen.append(Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                                            len(body)))
        path = self.path.split("?", 1)[0]
        if path.startswith("/bytes/"):
            self._send(200, b"x" * int(path.rsplit("/", 1)[1]))
        elif path == "/echo":
            self._send(200, json.dumps({"received": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                                        "host": self.headers.get("Host")}).encode(), "application/json")
        elif path in self.server.origin.redirects:
            self.send_response(302)
            self.send_header("Location", self.server.origin.redirects[path])
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif path in self.server.origin.files:
            content_type, data = self.server.origin.files[path]
            self._send(200, data, content_type)
        else:
            self._send(404, b"not here\n", "text/plain")

    do_GET = do_HEAD = do_POST = do_PUT = _handle


class _OriginServer(ThreadingHTTPServer):
    daemon_threads = True
    origin: Origin

    def finish_request(self, request: Any, client_address: Any) -> None:
        context = self.origin.tls
        if context is not None:
            try:
                request = context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                self.origin.failed_handshakes += 1
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that went away mid-request is part of these tests


@dataclass
class Origin:
    tls: ssl.SSLContext | None = None
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)
    redirects: dict[str, str] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    failed_handshakes: int = 0

    def __post_init__(self) -> None:
        self.server = _OriginServer(("127.0.0.1", 0), _Handler)
        self.server.origin = self
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Flow:
    """One connection through the tap: bytes from the proxy, bytes to it."""

    from_proxy: int = 0
    to_proxy: int = 0


class _TapHandler(socketserver.BaseRequestHandler):
    server: _TapServer

    def handle(self) -> None:
        tap = self.server.tap
        flow = Flow()
        with tap.lock:
            tap.opened += 1
        try:
            upstream = socket.create_connection(("127.0.0.1", tap.target), timeout=30)
        except OSError:
            return
        client: socket.socket = self.request

        def copy(src: socket.socket, dst: socket.socket, inbound: bool) -> None:
            try:
                while True:
                    data = src.recv(65536)
                    if not data:
                        break
                    dst.sendall(data)
                    if inbound:
                        flow.from_proxy += len(data)
                    else:
                        flow.to_proxy += len(data)
            except OSError:
                pass
            finally:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

        other = threading.Thread(target=copy, args=(upstream, client, False), daemon=True)
        other.start()
        copy(client, upstream, True)
        other.join(60)
        upstream.close()
        with tap.lock:
            tap.flows.append(flow)


class _TapServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    tap: Tap


@dataclass
class Tap:
    target: int
    flows: list[Flow] = field(default_factory=list)
    opened: int = 0

    def __post_init__(self) -> None:
        self.lock = threading.Lock()
        self.server = _TapServer(("127.0.0.1", 0), _TapHandler)
        self.server.tap = self
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def totals(self) -> tuple[int, int]:
        """(bytes the proxy sent, bytes the proxy received) over every finished connection."""
        with self.lock:
            return sum(f.from_proxy for f in self.flows), sum(f.to_proxy for f in self.flows)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def wheel(name: str, version: str) -> tuple[str, bytes]:
    """A minimal, valid pure-Python wheel (file name and bytes), for a package index stand-in."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"VALUE = 1\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: sandpool-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(f"{dist}/RECORD", record)
    return f"{name}-{version}-py3-none-any.whl", buffer.getvalue()
