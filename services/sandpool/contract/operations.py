"""The operations sandpool serves at the contract's paths: one table, read by the edge, the session layer and
their metrics (so an operation's name, a closed label set, is spelled once).

Contract v1 has six; `GetSession` (`GET /sessions/{id}`, the session's handle) and
`CancelExecution` (`DELETE /sessions/{id}/exec`, stop the running call) are sandpool's
additions, which no v1 client calls.
"""

from __future__ import annotations

import re

CONTRACT_OPERATIONS = ("CreateSession", "Execute", "DestroySession", "ListFiles", "GetFile", "PutFile")
OPERATIONS = (*CONTRACT_OPERATIONS, "GetSession", "CancelExecution")

ROUTES = (
    ("POST", "/sessions", "CreateSession"), ("GET", "/sessions/{session_id}", "GetSession"),
    ("DELETE", "/sessions/{session_id}", "DestroySession"), ("POST", "/sessions/{session_id}/exec", "Execute"),
    ("GET", "/sessions/{session_id}/files/list", "ListFiles"), ("GET", "/sessions/{session_id}/files", "GetFile"),
    ("POST", "/sessions/{session_id}/files", "PutFile"), ("DELETE", "/sessions/{session_id}/exec", "CancelExecution"),
)
"""(method, path template, operation) of every operation: what `operation_of` recognises."""

_SESSION_PATH = re.compile(r"^/sessions/[^/]+(/exec|/files/list|/files)?$")
_BY_SUFFIX = {
    ("POST", "/exec"): "Execute", ("GET", "/files/list"): "ListFiles", ("GET", "/files"): "GetFile",
    ("POST", "/files"): "PutFile", ("DELETE", ""): "DestroySession", ("GET", ""): "GetSession",
    ("DELETE", "/exec"): "CancelExecution",
}


def operation_of(method: str, path: str) -> str | None:
    """Which operation a request is, or None for any other method and path."""
    if path == "/sessions":
        return "CreateSession" if method == "POST" else None
    match = _SESSION_PATH.match(path)
    if match is None:
        return None
    return _BY_SUFFIX.get((method, match.group(1) or ""))
