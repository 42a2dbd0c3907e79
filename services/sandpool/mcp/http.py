"""`/mcp` on the api: who may call (the contract's own gate), and the SDK's transport loaded on first use.

Every request is authenticated first with the contract's gate: the same bearer JWTs,
401 with `WWW-Authenticate: Bearer` without a valid one (no OAuth metadata: sandpool is
not an authorization server), a revoked token refused; under `--no-auth` the one trusted
client. What the transport does with it is `sandpool.mcp.served`.

The `mcp` SDK costs over a second of imports (its types are pydantic models); an api
that never serves MCP should not pay it at every start, so it is imported (off the event
loop) and its session manager started on the first `/mcp` request, and stopped with the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sandpool.core.errors import SandpoolError, error_response
from sandpool.core.logs import request_id_var
from sandpool.mcp.caller import McpCaller
from sandpool.state import Client, Keys

if TYPE_CHECKING:
    from sandpool.mcp.served import Served

PATH = "/mcp"
OPERATION = "mcp"
"""What the edge's metrics call a request to `/mcp`."""

Authenticate = Callable[[Request, str], Awaitable[tuple[str, "str | None"]]]
"""The contract's authentication of a request (`sandpool.api.contract.Contract.authenticate`): its workspace and
credential, or a `SandpoolError` (401, 503) to answer with."""


class McpEndpoint:
    """The ASGI app served at `/mcp`; `serving(redis)` is entered by the api's lifespan."""

    def __init__(self, contract: ASGIApp, authenticate: Authenticate, keys: Keys) -> None:
        self.contract = contract
        """The api's in-process contract entry (the edge's request ids and metrics around `Contract.asgi`)."""
        self.authenticate = authenticate
        self.keys = keys
        self._redis: Client | None = None
        self._served: Served | None = None
        self._starting = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def serving(self, redis: Client) -> AsyncIterator[None]:
        self._redis = redis
        try:
            yield
        finally:
            served, self._served = self._served, None
            if served is not None:
                await served.stop()
            self._redis = None

    async def _transport(self) -> Served | None:
        if self._served is None:
            async with self._starting:
                if self._served is None and self._redis is not None:
                    await asyncio.to_thread(importlib.import_module, "sandpool.mcp.served")
                    from sandpool.mcp.served import Served

                    served = Served(self.contract, self.keys, self._redis)
                    await served.start()
                    self._served = served
        return self._served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            workspace, authorization = await self.authenticate(request, OPERATION)
        except SandpoolError as exc:
            await error_response(exc)(scope, receive, send)
            return
        caller = McpCaller(workspace, authorization, request_id=request_id_var.get() or None,
                           client=scope.get("client"))
        served = await self._transport()
        if served is None:  # (the app is stopping)
            await Response(status_code=503, headers={"Retry-After": "1"})(scope, receive, send)
            return
        await served.handle(request, caller, send)


__all__ = ["PATH", "McpEndpoint"]
