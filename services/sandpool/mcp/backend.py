"""What the MCP tools call: the contract's operations, answered in process (`/mcp`) or over HTTP (`sandpool mcp`).

A backend answers with the contract's own bodies (an Execute's response, a PutFile's)
and raises `CallRefused` for an operation that could not run, with the contract's
status, reason and detail; `SessionGone` when the session is unknown, ended, or
another workspace's (the contract answers all three alike).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

OnOutput = Callable[[str, str], Awaitable[None]]
"""Called with (`stdout`|`stderr`, text) as a streamed Execute's output arrives."""

UNKNOWN_SESSION_DETAIL = "session not found"
"""The contract's detail for an unknown session (sandpool.sessions.service.UNKNOWN_SESSION)."""


class CallRefused(Exception):
    """The contract refused the operation or could not run it."""

    def __init__(self, status: int, detail: str, *, reason: str = "", retry_after: str | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.reason = reason
        self.retry_after = retry_after


class SessionGone(CallRefused):
    """The session is not there for this caller: never leased, ended (destroyed, reaped, its sandbox lost), or
    another workspace's."""


def refusal(status: int, body: Any, retry_after: str | None = None) -> CallRefused:
    """The exception for an error answer of the contract (its JSON body, or None)."""
    fields = body if isinstance(body, dict) else {}
    detail = fields.get("detail")
    raw_reason = fields.get("reason")
    reason = raw_reason if isinstance(raw_reason, str) else ""
    if not isinstance(detail, str):
        detail = _validation_detail(detail) if isinstance(detail, list) else f"HTTP {status}"
    if status == 404 and detail == UNKNOWN_SESSION_DETAIL:
        return SessionGone(status, detail, reason=reason or "not_found")
    if reason == "session_ended" or (status in (502, 503) and "session is gone" in detail):
        return SessionGone(status, detail, reason=reason)
    return CallRefused(status, detail, reason=reason or "", retry_after=retry_after)


def _validation_detail(errors: list[Any]) -> str:
    parts = []
    for error in errors:
        if isinstance(error, dict):
            where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "input"
            parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "invalid input: " + "; ".join(parts) if parts else "invalid input"


class Backend(Protocol):
    """The contract operations the MCP tools use, for one caller (a workspace's token, or standalone)."""

    async def create_session(self) -> str:
        """CreateSession: the new session's id."""
        ...

    async def execute(self, session_id: str, body: dict[str, Any], on_output: OnOutput | None) -> dict[str, Any]:
        """Execute, streamed (output to `on_output` as it comes); the Execute response body."""
        ...

    async def cancel(self, session_id: str) -> None:
        """CancelExecution: stop the session's running call (nothing when none runs)."""
        ...

    async def put_file(self, session_id: str, path: str, data: bytes) -> dict[str, Any]:
        """PutFile: the stored path and size."""
        ...

    async def get_file(self, session_id: str, path: str) -> bytes:
        ...

    async def destroy_session(self, session_id: str) -> None:
        ...


__all__ = ["Backend", "CallRefused", "OnOutput", "SessionGone", "refusal"]
