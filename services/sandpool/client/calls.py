"""Each contract operation as a plain description of one HTTP call, shared by the sync and async clients.

A `Call` says what to send, how long to wait for the answer, whether it may be
offered again automatically, and how to read a successful answer. Building one
does no I/O, so the two clients differ only in how they send it.

Which calls are retried automatically (`Retry`):

- `SAFE` (DestroySession, ListFiles, GetFile): idempotent, nothing changes if the
  call is offered twice. Retried on 429, 503, and a connection that failed or broke.
- `REFUSED` (CreateSession): a 429 or 503 refusal leased nothing, so it is retried
  on those and on a connection that never opened; but not on one that broke
  mid-call, when a session may have been leased whose handle was lost (a retry
  would hold a second one until the first is reaped).
- `ONCE` (Execute, PutFile): not idempotent. Retried only when the connection
  failed before the request was sent; any answer, including 429/503, is raised
  for the caller to decide.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from sandpool.client.errors import ProtocolError
from sandpool.client.results import ExecResult, FileInfo, SessionInfo, UploadResult, file_infos_from_body
from sandpool.contract.reasons import Reason

Upload = bytes | bytearray | memoryview | IO[bytes]


class Retry(enum.Enum):
    SAFE = "safe"
    REFUSED = "refused"
    ONCE = "once"


@dataclass(frozen=True)
class Timeouts:
    """The client's time budget: `request` for every call, plus a margin on top of an exec's own timeout."""

    request: float = 30.0
    connect: float = 10.0
    exec_margin: float = 10.0
    exec_default: float = 300.0
    """Assumed exec timeout when neither the call nor the session handle states one."""

    def plain(self) -> httpx.Timeout:
        return httpx.Timeout(self.request, connect=min(self.connect, self.request))

    def for_exec(self, exec_seconds: float) -> httpx.Timeout:
        # The contract: allow more wall-clock than the backend is granted, or a
        # legitimate near-limit run reads as an unreachable backend.
        read = exec_seconds + self.exec_margin
        return httpx.Timeout(max(read, self.request), connect=min(self.connect, self.request))


T = TypeVar("T")


@dataclass
class Call(Generic[T]):
    """One contract call; `parse` turns its successful answer into the `T` the caller gets."""

    operation: str
    method: str
    path: str
    expect: tuple[int, ...]
    retry: Retry
    timeout: httpx.Timeout
    parse: Callable[[httpx.Response], T]
    params: dict[str, str] | None = None
    json: dict[str, Any] | None = None
    files: dict[str, Any] | None = None
    data: dict[str, str] | None = None
    absent_ok: bool = False
    """A 404 means the desired state already holds (DestroySession)."""
    rewind: Callable[[], bool] | None = field(default=None, repr=False)
    """Before a retry: put an uploaded stream back at its start; False when it cannot be."""


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError as exc:
        raise ProtocolError(f"{resp.request.method} {resp.request.url.path} answered non-JSON "
                            f"({resp.headers.get('content-type', 'no content type')})",
                            status=resp.status_code) from exc


def _session_path(session_id: str, suffix: str = "") -> str:
    if not session_id:
        raise ValueError("session_id must not be empty")
    return f"/sessions/{quote(session_id, safe='')}{suffix}"


def create_session(timeouts: Timeouts, *, idle_timeout_seconds: int | None = None,
                   max_lifetime_seconds: int | None = None, image: str | None = None,
                   **extra: Any) -> Call[SessionInfo]:
    body: dict[str, Any] = {k: v for k, v in {
        "idle_timeout_seconds": idle_timeout_seconds,
        "max_lifetime_seconds": max_lifetime_seconds,
        "image": image,
    }.items() if v is not None}
    body.update({k: v for k, v in extra.items() if v is not None})
    return Call("create_session", "POST", "/sessions", (201, 200), Retry.REFUSED, timeouts.plain(),
                lambda r: SessionInfo.from_body(_json(r)), json=body)


def destroy_session(timeouts: Timeouts, session_id: str) -> Call[None]:
    return Call("destroy_session", "DELETE", _session_path(session_id), (204, 200), Retry.SAFE,
                timeouts.plain(), lambda r: None, absent_ok=True)


def exec_budget(timeouts: Timeouts, timeout_seconds: int | None, session_default: int | None,
                session_max: int | None) -> float:
    """The longest the server may run this exec, as far as the client can tell.

    The call's own `timeout_seconds` (clamped by the server to the session's
    ceiling, which a sandpool handle reports), else the session's default in
    force, else `Timeouts.exec_default` for a backend that reports neither.
    """
    if timeout_seconds is not None:
        return float(min(timeout_seconds, session_max) if session_max else timeout_seconds)
    if session_default:
        return float(session_default)
    return float(session_max or timeouts.exec_default)


def execute(timeouts: Timeouts, session_id: str, tool: str, tool_input: dict[str, Any], *,
            timeout_seconds: int | None, tool_use_id: str | None, session_exec_timeout: int | None = None,
            session_max_exec_timeout: int | None = None) -> Call[ExecResult]:
    body: dict[str, Any] = {"tool": tool, "input": tool_input}
    if timeout_seconds is not None:
        body["timeout_seconds"] = timeout_seconds
    if tool_use_id is not None:
        body["tool_use_id"] = tool_use_id
    budget = exec_budget(timeouts, timeout_seconds, session_exec_timeout, session_max_exec_timeout)
    return Call("execute", "POST", _session_path(session_id, "/exec"), (200,), Retry.ONCE,
                timeouts.for_exec(budget), lambda r: ExecResult.from_body(_json(r)), json=body)


def cancel_exec(timeouts: Timeouts, session_id: str) -> Call[bool]:
    """CancelExecution (sandpool's addition): True when a running call was stopped (200 naming it; 204
    from a server before call ids), False when none was running (409 `no_running_call`)."""
    return Call("cancel_exec", "DELETE", _session_path(session_id, "/exec"), (200, 204, 409), Retry.ONCE,
                timeouts.plain(), _cancelled)


def _cancelled(resp: httpx.Response) -> bool:
    if resp.status_code in (200, 204):
        return True
    try:
        reason = resp.json().get("reason")
    except (ValueError, AttributeError):
        reason = None
    if reason != Reason.NO_RUNNING_CALL:
        raise ProtocolError(f"CancelExecution answered 409 for another reason than {Reason.NO_RUNNING_CALL}",
                            status=resp.status_code)
    return False


def editor_input(command: str, path: str, **fields: Any) -> dict[str, Any]:
    return {"command": command, "path": path, **{k: v for k, v in fields.items() if v is not None}}


def list_files(timeouts: Timeouts, session_id: str, path: str = ".") -> Call[list[FileInfo]]:
    return Call("list_files", "GET", _session_path(session_id, "/files/list"), (200,), Retry.SAFE,
                timeouts.plain(), lambda r: file_infos_from_body(_json(r)), params={"path": path})


def get_file(timeouts: Timeouts, session_id: str, path: str) -> Call[bytes]:
    if not path:
        raise ValueError("path must not be empty")
    return Call("get_file", "GET", _session_path(session_id, "/files"), (200,), Retry.SAFE,
                timeouts.plain(), lambda r: r.content, params={"path": path})


def put_file(timeouts: Timeouts, session_id: str, path: str, data: Upload) -> Call[UploadResult]:
    """PutFile: `data` is bytes or a binary file object (streamed, not read into memory)."""
    if not path:
        raise ValueError("path must not be empty")
    if isinstance(data, str):
        raise TypeError("upload data must be bytes or a binary file, not str (encode it first)")
    filename = os.path.basename(path.rstrip("/")) or "upload"
    payload: Any
    rewind: Callable[[], bool] | None = None
    if isinstance(data, (bytes, bytearray, memoryview)):
        payload = bytes(data)
    else:
        payload = data
        start = data.tell() if data.seekable() else None

        def rewind() -> bool:
            if start is None:
                return False
            data.seek(start)
            return True

    return Call("put_file", "POST", _session_path(session_id, "/files"), (201, 200), Retry.ONCE,
                timeouts.plain(), lambda r: UploadResult.from_body(_json(r)),
                files={"file": (filename, payload, "application/octet-stream")}, data={"path": path},
                rewind=rewind)


__all__ = [
    "Call",
    "Retry",
    "Timeouts",
    "Upload",
    "cancel_exec",
    "create_session",
    "destroy_session",
    "editor_input",
    "exec_budget",
    "execute",
    "get_file",
    "list_files",
    "put_file",
]
