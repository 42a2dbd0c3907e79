"""Who sent an MCP request: what `/mcp`'s endpoint learnt of it and the tool handlers read from the request
scope (a module of its own, so the endpoint and the SDK-served handlers import it, not each other)."""

from __future__ import annotations

from dataclasses import dataclass

CALLER_KEY = "sandpool.mcp.caller"
"""The request scope's key holding the `McpCaller`."""


@dataclass(frozen=True)
class McpCaller:
    """Who sent this MCP request, as the gate verified it; the tool handlers read it from the request scope."""

    workspace: str
    authorization: str | None
    mcp_session_id: str | None = None
    request_id: str | None = None
    client: tuple[str, int] | None = None


__all__ = ["CALLER_KEY", "McpCaller"]
