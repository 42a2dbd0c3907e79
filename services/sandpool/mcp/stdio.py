"""`sandpool mcp`: sandpool's MCP tools over stdio for desktop clients, against a sandpool URL with a token.

The same tools and results as `/mcp` (`sandpool.mcp.server`), reaching the contract over
HTTP through `sandpool.client`. A client of the previous revision has one default session
for the life of this process (what a call without `session_id` uses, as an `Mcp-Session-Id`
gives over HTTP), ended when the process exits; the current revision's calls name their
session or lease a new one. Only the protocol is written to stdout; logs go to stderr.
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
from mcp.server.context import ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from sandpool.client import AsyncClient, SandpoolClientError
from sandpool.mcp.remote import ClientBackend
from sandpool.mcp.server import Binding, build_server

log = logging.getLogger(__name__)


class ProcessDefault:
    """The default session of this process's one client (previous revision), in memory."""

    def __init__(self) -> None:
        self.session: str | None = None

    async def get(self) -> str | None:
        return self.session

    async def bind(self, session_id: str) -> str | None:
        if self.session is None:
            self.session = session_id
        return self.session

    async def forget(self, session_id: str) -> None:
        if self.session == session_id:
            self.session = None

    async def running(self, request_id: str, session_id: str) -> None:
        """(A cancel over stdio cancels the call's task in this process: nothing to record.)"""

    async def finished(self, request_id: str) -> None:
        """(See `running`.)"""


async def serve(url: str, token: str | None) -> None:
    async with AsyncClient(url, token, max_retries=2) as client:
        backend = ClientBackend(client)
        default = ProcessDefault()

        def binding(ctx: ServerRequestContext[Any, Any]) -> Binding:
            previous = ctx.protocol_version in HANDSHAKE_PROTOCOL_VERSIONS
            return Binding(backend, default if previous else None)

        server = build_server(binding)
        try:
            async with stdio_server() as (read_stream, write_stream):
                await server.run(read_stream, write_stream, server.create_initialization_options())
        finally:
            if default.session is not None:
                with anyio.CancelScope(shield=True):
                    try:
                        await client.destroy_session(default.session)
                    except SandpoolClientError as exc:
                        log.warning("could not end the default session", extra={"error": type(exc).__name__})


__all__ = ["ProcessDefault", "serve"]
