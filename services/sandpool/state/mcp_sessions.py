"""MCP sessions of the previous protocol revision (`Mcp-Session-Id`), kept in Redis so any api replica
serves them, each bound to the workspace that opened it.

An MCP session maps to at most one sandpool session: the one its tool calls without a
`session_id` use, leased by the first such call and released when the MCP session is
deleted. Another workspace's MCP session id reads exactly as an unknown one. While a tool
call runs, its JSON-RPC request id names the sandpool session it runs in (`running`), so a
cancel notification reaching another replica can stop it. Every record expires.

Each change is one atomic script (`state/lua/mcp_*.lua`): KEYS[1] is the MCP session's hash
(`Keys.mcp_session`); a hash of another workspace is left untouched.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

from sandpool.state import scripts
from sandpool.state.client import Client
from sandpool.state.errors import translated
from sandpool.state.keys import Keys

IDLE_TTL_SECONDS = 24 * 3600
"""An MCP session nobody used for this long is forgotten (its sandpool session is reaped on its own)."""
CALL_TTL_SECONDS = 3600
"""The longest a running call's record outlives an api that crashed under it."""


@dataclass(frozen=True)
class McpSession:
    """An MCP session as its own workspace sees it: its id and its sandpool session ('' when none yet)."""

    id: str
    session: str


def new_mcp_session_id() -> str:
    # 144 random bits, visible ASCII only (the transport's rule for Mcp-Session-Id).
    return secrets.token_urlsafe(18)


class McpSessionStore:
    def __init__(self, client: Client, keys: Keys, *, idle_ttl: int = IDLE_TTL_SECONDS) -> None:
        self.redis = client
        self.keys = keys
        self.idle_ttl = idle_ttl
        self._open = client.register_script(scripts.load("mcp_open"))
        self._lookup = client.register_script(scripts.load("mcp_lookup"))
        self._bind = client.register_script(scripts.load("mcp_bind"))
        self._unbind = client.register_script(scripts.load("mcp_unbind"))
        self._close = client.register_script(scripts.load("mcp_close"))

    @translated
    async def open(self, workspace: str) -> McpSession:
        """A new MCP session of `workspace`, with no sandpool session yet."""
        mcp_id = new_mcp_session_id()
        await self._open(keys=[self.keys.mcp_session(mcp_id)],
                         args=_named(workspace=workspace, ttl_ms=self.idle_ttl * 1000))
        return McpSession(mcp_id, "")

    @translated
    async def lookup(self, mcp_id: str, workspace: str) -> McpSession | None:
        """The MCP session (its idle expiry refreshed); None when unknown, expired or another workspace's."""
        found = await self._lookup(keys=[self.keys.mcp_session(mcp_id)],
                                   args=_named(workspace=workspace, ttl_ms=self.idle_ttl * 1000))
        if not found:
            return None
        return McpSession(mcp_id, _text(found[0]))

    @translated
    async def bind(self, mcp_id: str, workspace: str, session: str) -> str | None:
        """Bind a freshly leased `session` unless one is bound already: the bound one (None: the MCP session
        is gone)."""
        bound = await self._bind(keys=[self.keys.mcp_session(mcp_id)], args=_named(workspace=workspace,
                                                                                         session=session))
        return _text(bound) if bound else None

    @translated
    async def unbind(self, mcp_id: str, workspace: str, session: str) -> bool:
        """Forget an ended `session` (only if it is still the one bound), so the next call leases anew."""
        return bool(await self._unbind(keys=[self.keys.mcp_session(mcp_id)],
                                       args=_named(workspace=workspace, session=session)))

    @translated
    async def close(self, mcp_id: str, workspace: str) -> McpSession | None:
        """Delete the MCP session; it as it was (its sandpool session is the caller's to release)."""
        found = await self._close(keys=[self.keys.mcp_session(mcp_id)], args=_named(workspace=workspace))
        if not found:
            return None
        return McpSession(mcp_id, _text(found[0]))

    @translated
    async def running(self, mcp_id: str, request_id: str, session: str) -> None:
        """A tool call of the MCP session, by its JSON-RPC request id, runs in `session`."""
        await self.redis.set(self.keys.mcp_call(mcp_id, request_id), session, ex=CALL_TTL_SECONDS)

    @translated
    async def finished(self, mcp_id: str, request_id: str) -> None:
        await self.redis.delete(self.keys.mcp_call(mcp_id, request_id))

    @translated
    async def running_in(self, mcp_id: str, request_id: str) -> str | None:
        """The sandpool session the call runs in, None when it is not running (or never ran)."""
        found = await self.redis.get(self.keys.mcp_call(mcp_id, request_id))
        return _text(found) if found else None


def _named(**arguments: object) -> list[str]:
    """ARGV as every script takes it: one JSON object of named arguments in ARGV[1], decoded as `a`."""
    return [json.dumps(arguments, separators=(",", ":"))]


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["CALL_TTL_SECONDS", "IDLE_TTL_SECONDS", "McpSession", "McpSessionStore", "new_mcp_session_id"]
