"""Real parts for the MCP tests: two `sandpool api` processes (auth on) sharing the test's Redis, real agents
published as ready sandboxes, tokens of the test's own key pair, and the `mcp` SDK's own client, whose HTTP
requests alternate between the two replicas (as a load balancer would spread them)."""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from sandbox_env import built_python
from testkit import AgentProcess, free_port, wait_http

from sandpool.edge.keys_cli import mint_token
from sandpool.state import close, connect
from sandpool.state.keys import Keys
from sandpool.state.sandboxes import SandboxStore

LEGACY = "legacy"
"""The SDK client's mode for the previous revision (the initialize handshake, `Mcp-Session-Id`)."""
CURRENT = "2026-07-28"
"""The current revision, pinned (stateless: no handshake, no MCP session)."""
INSPECTOR = "SANDPOOL_TEST_MCP_INSPECTOR"


class ApiReplica:
    """`sandpool api` as a real subprocess: multi-tenant, trusting the test's public key, or `--no-auth`."""

    def __init__(self, redis_url: str, prefix: str, public_key: Path | None, *extra: str) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="mcp-api", suffix=".log", delete=False)
        auth = ["--auth-public-keys", str(public_key)] if public_key is not None else ["--no-auth"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandpool", "api", *auth, "--capacity-wait-seconds", "0", "--port", str(self.port),
             "--redis-url", redis_url, "--redis-prefix", prefix, "--log-level", "warning", *extra],
            stdout=self.log, stderr=self.log, stdin=subprocess.DEVNULL)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        wait_http(self.url + "/readyz", proc=self.proc, log=Path(self.log.name), timeout=30, what="api ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        Path(self.log.name).unlink(missing_ok=True)


def agent_args() -> list[str]:
    """The built sandbox environment when there is one (matplotlib, for figures), else the host's Python."""
    python = built_python()
    if python is None:
        return []
    from sandpool.providers.local import environments

    built = environments.from_interpreter(python)
    args = ["--python-executable", python]
    if built.matplotlib_cache:
        args += ["--matplotlib-cache", built.matplotlib_cache]
    return args


class Sandboxes:
    """Real agents on Unix sockets, each published as a ready sandbox by the controller's own state API."""

    def __init__(self, redis_url: str, keys: Keys) -> None:
        self.redis_url, self.keys = redis_url, keys
        self.root = Path(tempfile.mkdtemp(prefix="spm", dir="/tmp"))
        self.args = agent_args()
        self.started: list[AgentProcess] = []

    @property
    def figures(self) -> bool:
        return bool(self.args)

    async def add(self, count: int) -> None:
        fresh = []
        for _ in range(count):
            name = uuid.uuid4().hex[:8]
            fresh.append(AgentProcess(self.root / f"w{name}", self.root / f"{name}.log", *self.args,
                                      socket_path=self.root / f"{name}.sock").start())
        self.started.extend(fresh)
        client = connect(self.redis_url, timeout=5)
        try:
            store = SandboxStore(client, self.keys, record_ttl_seconds=3600)
            for agent in fresh:
                await asyncio.to_thread(agent.wait_healthy, 30)
                sandbox_id = "sb-" + uuid.uuid4().hex[:12]
                assert await store.register_starting(sandbox_id, pool="default", image="python", ceiling=1 << 30,
                                                     now=time.time(), owner="tests")
                assert await store.publish_ready(sandbox_id, pool="default", address=agent.address,
                                                 secret=agent.secret, now=time.time())
        finally:
            await close(client)

    def stop(self) -> None:
        for agent in self.started:
            agent.kill()
        shutil.rmtree(self.root, ignore_errors=True)


class RoundRobin(httpx2.AsyncBaseTransport):
    """Sends each request to the next replica in turn: no request of an MCP session sticks to one api."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.targets = itertools.cycle([httpx2.URL(u) for u in urls])
        self.inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        target = next(self.targets)
        request.url = request.url.copy_with(host=target.host, port=target.port)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@asynccontextmanager
async def mcp_client(urls: Sequence[str], token: str | None, mode: str, **kwargs: Any):
    """The SDK's own `Client` over streamable HTTP, its requests alternating between `urls`."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    http = httpx2.AsyncClient(headers=headers, transport=RoundRobin(urls), timeout=httpx2.Timeout(60, read=120))
    async with http:
        transport = streamable_http_client(urls[0] + "/mcp", http_client=http)
        async with Client(transport, mode=mode, **kwargs) as client:
            yield client


def token(private_key: Path, workspace: str) -> str:
    return mint_token(private_key, workspace)


def inspector() -> str | None:
    path = os.environ.get(INSPECTOR)
    return path if path and os.access(path, os.X_OK) else None


__all__ = ["CURRENT", "INSPECTOR", "LEGACY", "ApiReplica", "RoundRobin", "Sandboxes", "inspector", "mcp_client",
           "token"]
