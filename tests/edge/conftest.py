"""Fixtures of the proxy tests: real uvicorn servers on loopback, a real Redis, real keys.

Until a scheduler is in the loop, the proxy forwards to an echo peer: a tiny real
HTTP server that records every request it receives (method, path, headers, body)
so a test can prove what crossed the proxy and what did not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import testkit
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sandpool.edge.app import create_app
from sandpool.edge.keys_cli import generate_keypair, mint_token
from sandpool.edge.settings import ProxySettings
from sandpool.sessions import app as scheduler_app
from sandpool.sessions import settings as scheduler_settings
from sandpool.state.keys import Keys as RedisKeys

from .stack import Sandboxes, Stack

INTERNAL_TOKEN = "internal-credential-for-tests"


class CaplogServer(testkit.ThreadServer):
    """A real uvicorn server on a loopback port, in a thread of the test process (logging through the
    test's own handlers, so `caplog` sees it)."""

    def __init__(self, app: Any) -> None:
        # timeout_graceful_shutdown bounds a stop when a peer's request task lingers
        super().__init__(app, log_config=None, lifespan="on", access_log=False, timeout_graceful_shutdown=2)


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name.lower()]


@dataclass
class Echo:
    server: CaplogServer
    seen: list[Seen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url


def echo_app(seen: list[Seen]) -> Starlette:
    async def record(request: Request) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:
            return Response(status_code=400)  # the proxy gave up on the upload: nothing to record
        seen.append(Seen(request.method, request.url.path, request.url.query,
                         [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.scope["headers"]], body))
        if request.method == "POST" and request.url.path == "/sessions":
            return JSONResponse({"session_id": f"s{len(seen)}"}, status_code=201)
        if request.url.path.endswith("/files") and request.method == "GET":
            size = int(request.query_params.get("size", "0"))

            async def chunks() -> Any:
                sent = 0
                while sent < size:
                    n = min(65536, size - sent)
                    yield b"x" * n
                    sent += n

            return StreamingResponse(chunks(), media_type="application/octet-stream",
                                     headers={"x-sandpool-outcome": "ok", "connection": "close"}
                                     if request.query_params.get("hop") else None)
        headers = {"x-request-id": "upstream-must-not-leak"}
        if request.query_params.get("cookie"):
            headers["set-cookie"] = "sid=tenant-secret; Path=/"
        return JSONResponse({"method": request.method, "path": request.url.path, "body_len": len(body),
                             "body_sha256": hashlib.sha256(body).hexdigest()}, headers=headers)

    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(routes=[Route("/healthz", healthz),
                             Route("/{path:path}", record, methods=["GET", "POST", "DELETE", "PUT"])])


@pytest.fixture
def echo() -> Iterator[Echo]:
    seen: list[Seen] = []
    server = CaplogServer(echo_app(seen)).start()
    yield Echo(server, seen)
    server.stop()


@dataclass
class Keys:
    private: Path
    public: Path

    def token(self, workspace: str = "acme", **kwargs: Any) -> str:
        return mint_token(self.private, workspace, **kwargs)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    private, public = generate_keypair(tmp_path / "keys" / "signing.pem")
    return Keys(private, public)


@pytest.fixture
def other_keys(tmp_path: Path) -> Keys:
    private, public = generate_keypair(tmp_path / "other" / "untrusted.pem")
    return Keys(private, public)


@dataclass
class Proxy:
    server: CaplogServer
    settings: ProxySettings

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, token: str | None = None, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kwargs)


@pytest.fixture
def make_proxy(redis_url: str, redis_prefix: str, keys: Keys, echo: Echo) -> Iterator[Callable[..., Proxy]]:
    started: list[CaplogServer] = []

    def make(**overrides: Any) -> Proxy:
        values: dict[str, Any] = {"redis_url": redis_url, "redis_prefix": redis_prefix,
                                  "scheduler_url": echo.url, "auth_public_keys": [str(keys.public)],
                                  "internal_token": INTERNAL_TOKEN}
        values.update(overrides)
        settings = ProxySettings(**values)
        server = CaplogServer(create_app(settings)).start()
        started.append(server)
        return Proxy(server, settings)

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def proxy(make_proxy: Callable[..., Proxy]) -> Proxy:
    return make_proxy()


@pytest.fixture
def rdb(redis_url: str, redis_prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    for key in client.scan_iter(match="{" + redis_prefix + "}:*", count=1000):  # this test's keys only
        client.delete(key)
    client.close()


@pytest.fixture
def stack_factory(redis_url: str, redis_prefix: str, keys: Keys, rdb: redis.Redis) -> Iterator[Callable[[], Stack]]:
    rkeys = RedisKeys(redis_prefix)
    sandboxes = Sandboxes(rdb, rkeys)
    servers: list[CaplogServer] = []

    def start() -> Stack:
        """A fresh proxy and scheduler on the same Redis (call again to 'restart' both)."""
        for server in reversed(servers):  # the proxy first: it holds connections to the scheduler
            server.stop()
        servers.clear()
        sched = scheduler_app.create_app(scheduler_settings.SchedulerSettings(
            standalone=False, internal_token=INTERNAL_TOKEN, controller=False, redis_url=redis_url,
            redis_prefix=redis_prefix, reap_interval_seconds=0.2, capacity_wait_seconds=0))
        scheduler = CaplogServer(sched).start()
        servers.append(scheduler)
        proxy = CaplogServer(create_app(ProxySettings(
            redis_url=redis_url, redis_prefix=redis_prefix, scheduler_url=scheduler.url,
            auth_public_keys=[str(keys.public)], internal_token=INTERNAL_TOKEN))).start()
        servers.append(proxy)
        return Stack(proxy, scheduler, keys, sandboxes, rdb, rkeys)

    yield start
    for server in reversed(servers):
        server.stop()
    sandboxes.stop()


@pytest.fixture
def stack(stack_factory: Callable[[], Stack]) -> Stack:
    return stack_factory()
