"""Fixtures of the egress tests: origins on loopback behind counting taps, a real Redis, the real proxy.

The proxy runs in the test's event loop (`EgressProxy` on a socket bound like
the process binds it); `process` runs it as a real `sandpool egress` process too,
on the same Redis and key prefix, with a Unix socket as local sandboxes reach it. Test
names are mapped by the proxy's own resolver (`--resolve-overrides`), never by
/etc/hosts: `*.example.test` names to the loopback origins, others to the
addresses the address policy must refuse. Loopback is admitted only through
the test-only setting, and the tests of loopback refusal turn it off.

Sessions are real: a sandbox record published with its egress credential's
digest and leased with the session layer's own scripts, which bind the credential to
the session and its allow-list (and the release unbinds it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from testkit import free_port, scrubbed_env, wait_http

from sandpool.core.serve import bind
from sandpool.egress.server import EgressProxy
from sandpool.egress.serving import build_resolver
from sandpool.egress.settings import EgressSettings
from sandpool.state import Keys, close, connect
from sandpool.state.egress import EgressStore
from sandpool.state.keys import egress_digest
from sandpool.state.sandboxes import SandboxStore
from sandpool.state.sessions import Leased, SessionLimits, SessionStore

from .origins import TEST_NAMES, Certificate, Origin, Tap, make_certificate

WORKSPACE = "ws-egress"
LIMITS = SessionLimits(idle_timeout_seconds=300, max_lifetime_seconds=3600, exec_timeout_seconds=30,
                       max_exec_timeout_seconds=60)
OVERRIDES = [f"{name}=127.0.0.1" for name in TEST_NAMES] + [
    "loopback.example.test=127.0.0.1",
    "loopback6.example.test=::1",
    "metadata.example.test=169.254.169.254",
    "private.example.test=10.1.2.3",
    "mapped.example.test=::ffff:127.0.0.1",
    "mapped-metadata.example.test=::ffff:169.254.169.254",
    "cgnat.example.test=100.100.100.200",
    "denied.example.test=8.8.8.8",
    "mixed.example.test=127.0.0.1",
    "mixed.example.test=10.0.0.1",
]


@pytest.fixture(scope="session")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Certificate:
    return make_certificate(tmp_path_factory.mktemp("egress-cert"))


@dataclass
class Outside:
    """The internet as the tests see it: an HTTPS and an HTTP origin, each behind a counting tap."""

    certificate: Certificate
    https: Origin
    https_tap: Tap
    http: Origin
    http_tap: Tap

    def https_url(self, path: str, name: str = "files.example.test") -> str:
        return f"https://{name}:{self.https_tap.port}{path}"

    def http_url(self, path: str, name: str = "files.example.test") -> str:
        return f"http://{name}:{self.http_tap.port}{path}"


@pytest.fixture
def outside(certificate: Certificate) -> Iterator[Outside]:
    https = Origin(tls=certificate.server_context())
    http = Origin()
    https_tap, http_tap = Tap(https.port), Tap(http.port)
    try:
        yield Outside(certificate, https, https_tap, http, http_tap)
    finally:
        for part in (https_tap, http_tap, https, http):
            part.close()


@dataclass(frozen=True)
class Bound:
    credential: str
    session: str
    workspace: str


@dataclass
class Egress:
    proxy: EgressProxy
    port: int
    settings: EgressSettings
    store: EgressStore
    sessions: SessionStore
    sandboxes: SandboxStore
    keys: Keys
    bound: list[Bound] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, credential: str, user: str = "sandbox") -> str:
        return f"http://{user}:{credential}@{self.address}"

    async def bind_session(self, allow: list[str], *, workspace: str = WORKSPACE,
                           limits: dict[str, int] | None = None) -> Bound:
        """A live session with a fresh egress credential bound to it, as the api leases it: the sandbox
        published with the credential's digest, the lease binding it to the session and `allow`, and
        recording the workspace's lease `limits` (as the session layer passes them) on the session."""
        now = time.time()
        sandbox, session = f"sb-{uuid.uuid4().hex[:10]}", f"se-{uuid.uuid4().hex[:10]}"
        credential = secrets.token_urlsafe(32)
        assert await self.sandboxes.register_starting(sandbox, pool="default", image="python", ceiling=1000,
                                                      now=now, owner="egress-tests")
        assert await self.sandboxes.publish_ready(sandbox, pool="default", address="unix:///nowhere",
                                                  secret="agent-secret", now=now,
                                                  egress_digest=egress_digest(credential))
        leased = await self.sessions.lease(session_id=session, workspace=workspace, pool="default", image="python",
                                           now=now, limits=LIMITS, workspace_limits=limits or {},
                                           egress_allow=allow)
        assert isinstance(leased, Leased) and leased.sandbox == sandbox
        bound = Bound(credential, session, workspace)
        self.bound.append(bound)
        return bound

    async def release(self, bound: Bound) -> None:
        assert await self.sessions.release(session_id=bound.session, workspace=bound.workspace, now=time.time(),
                                           mode="destroy")

    async def usage(self, workspace: str = WORKSPACE) -> dict[str, str]:
        return dict(await self.store.redis.hgetall(self.keys.usage_total(workspace)))

    async def events(self, kind: str = "egress") -> list[dict[str, str]]:
        entries = await self.store.redis.xrange(self.keys.usage_events)
        return [fields for _id, fields in entries if fields.get("type") == kind]


MakeEgress = Callable[..., Awaitable[Egress]]


@pytest.fixture
async def make_egress(redis_url: str, redis_prefix: str, outside: Outside) -> AsyncIterator[MakeEgress]:
    made: list[tuple[Egress, Any]] = []

    async def make(*, ceiling: list[str] | None = None, loopback: bool = True, **overrides: Any) -> Egress:
        overrides.setdefault("shutdown_grace_seconds", 0.2)
        if ceiling is None:
            ceiling = [f"*:{outside.https_tap.port}", f"*:{outside.http_tap.port}",
                       f"127.0.0.1:{outside.https_tap.port}", f"[::1]:{outside.https_tap.port}"]
        settings = EgressSettings(
            redis_url=redis_url, redis_prefix=redis_prefix, egress_allow_ceiling=ceiling,
            resolve_overrides=OVERRIDES, unsafe_allow_loopback_for_tests=loopback,
            unsafe_mode="tests" if loopback else "", **overrides)
        client = connect(redis_url, timeout=2.0)
        keys = Keys(redis_prefix)
        store = EgressStore(client, keys)
        proxy = EgressProxy(settings, store=store, resolver=build_resolver(settings))
        sock = bind("127.0.0.1", 0)
        port = sock.getsockname()[1]
        await proxy.start([sock])
        egress = Egress(proxy, port, settings, store, SessionStore(client, keys),
                        SandboxStore(client, keys, record_ttl_seconds=3600), keys)
        made.append((egress, client))
        return egress

    yield make
    for egress, client in made:
        await egress.proxy.aclose()
        await close(client)


@pytest.fixture
async def egress(make_egress: MakeEgress) -> Egress:
    return await make_egress()


@dataclass
class Process:
    proc: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    unix_socket: Path
    log: Path


@pytest.fixture
def process(tmp_path: Path, redis_url: str, redis_prefix: str, outside: Outside) -> Iterator[Process]:
    port, metrics_port = free_port(), free_port()
    sock_dir = Path(tempfile.mkdtemp(prefix="spe-"))  # short, whatever tmp_path's length
    unix_socket = sock_dir / "egress.sock"
    log = tmp_path / "egress.log"
    env = scrubbed_env(SANDPOOL_RESOLVE_OVERRIDES=",".join(OVERRIDES))
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandpool", "egress", "--port", str(port), "--metrics-port", str(metrics_port),
             "--unix-socket", str(unix_socket), "--redis-url", redis_url, "--redis-prefix", redis_prefix,
             "--egress-allow-ceiling", f"*:{outside.https_tap.port}", "--unsafe-allow-loopback-for-tests",
             "--unsafe-mode", "tests"], stdout=out, stderr=out, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", proc=proc, log=log, timeout=30, what="egress")
        yield Process(proc, port, metrics_port, unix_socket, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if unix_socket.exists():
            unix_socket.unlink()
        sock_dir.rmdir()


def basic(credential: str, user: str = "sandbox") -> str:
    return "Basic " + base64.b64encode(f"{user}:{credential}".encode()).decode()


@dataclass
class Answer:
    status: int
    phrase: str
    headers: dict[str, str]
    body: bytes


async def raw_request(port: int, head: str, body: bytes = b"", *, read_body: bool = True) -> Answer:
    """Send a request head (CRLF added) to the proxy and read its answer head (and body) as bytes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode("latin-1") + b"\r\n\r\n" + body)
        await writer.drain()
        return await read_answer(reader, read_body=read_body)
    finally:
        writer.close()


async def read_answer(reader: asyncio.StreamReader, *, read_body: bool = True) -> Answer:
    raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    lines = raw[:-4].decode("latin-1").split("\r\n")
    _version, status, phrase = (lines[0].split(" ", 2) + [""])[:3]
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = b""
    if read_body and "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 30)
    return Answer(int(status), phrase, headers, body)


def connect_head(authority: str, credential: str | None) -> str:
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if credential is not None:
        lines.append(f"Proxy-Authorization: {basic(credential)}")
    return "\r\n".join(lines)


def json_body(answer: Answer) -> Any:
    return json.loads(answer.body)


def clean_env(**extra: str) -> dict[str, str]:
    """An environment for a client subprocess: no inherited proxy settings, only what the test gives."""
    import os

    env = {k: v for k, v in os.environ.items()
           if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "ssl_cert_file",
                                "requests_ca_bundle", "curl_ca_bundle")
           and not k.startswith(("SANDPOOL_", "PIP_"))}
    env.update(extra)
    return env


def cert_path(outside: Outside) -> Path:
    return outside.certificate.cert
