"""What the client hands back: small frozen views over the contract's response bodies.

Each is validated against the contract models (`sandpool.contract`) and keeps
the decoded body in `raw`, so fields a newer server adds (the contract grows
additively) are never lost: read them from `raw` or through `extra()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sandpool.client.errors import ProtocolError
from sandpool.contract import ExecResponse, FileList, FileUploadResult, SessionHandle
from sandpool.contract.models import ValidationError


def _validate(model: Any, body: Any, what: str) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise ProtocolError(f"the server's {what} response does not match contract v1: "
                            f"{exc.error_count()} error(s)") from exc


@dataclass(frozen=True)
class SessionInfo:
    """A session handle: the id plus the lifetimes (and, from sandpool, image and exec timeout) in force."""

    session_id: str
    idle_timeout_seconds: int | None = None
    max_lifetime_seconds: int | None = None
    created_at: float | None = None
    last_activity_at: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def image(self) -> str | None:
        """sandpool extension: the image the session runs (the request's `image` hint may be ignored)."""
        value = self.raw.get("image")
        return value if isinstance(value, str) else None

    def _int(self, name: str) -> int | None:
        value = self.raw.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def exec_timeout_seconds(self) -> int | None:
        """sandpool extension: the timeout of an Execute that names none."""
        return self._int("exec_timeout_seconds")

    @property
    def max_exec_timeout_seconds(self) -> int | None:
        """sandpool extension: the most `timeout_seconds` an Execute may get (larger is clamped)."""
        return self._int("max_exec_timeout_seconds")

    @property
    def pool(self) -> str | None:
        """sandpool extension: the pool the session's sandbox came from."""
        value = self.raw.get("pool")
        return value if isinstance(value, str) else None

    @classmethod
    def from_body(cls, body: Any) -> SessionInfo:
        handle = _validate(SessionHandle, body, "CreateSession")
        return cls(
            session_id=handle.session_id,
            idle_timeout_seconds=handle.idle_timeout_seconds,
            max_lifetime_seconds=handle.max_lifetime_seconds,
            created_at=handle.created_at,
            last_activity_at=handle.last_activity_at,
            raw=dict(body),
        )


@dataclass(frozen=True)
class OutputFile:
    """A file an execution produced: `file_id` addresses it, `filename` is the name it was given."""

    file_id: str
    filename: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one Execute.

    A program that failed is still a result: check `ok` (or `return_code` and
    `stderr`). Only a call the server could not run at all raises.
    """

    stdout: str
    stderr: str
    return_code: int
    files: tuple[OutputFile, ...]
    tool_use_id: str
    execution_time_ms: int | None
    type: str
    """The result block's type, e.g. `code_execution_tool_result` (opaque; may be new)."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """The program exited 0 and no limit stopped it."""
        return self.return_code == 0 and not self.timed_out and not self.cancelled and self.limit is None

    def extra(self, name: str) -> Any:
        """An extension field, looked up on the response, then on the result payload."""
        if name in self.raw:
            return self.raw[name]
        content = self.raw.get("result_block", {}).get("content", {})
        return content.get(name) if isinstance(content, dict) else None

    @property
    def limit(self) -> str | None:
        """sandpool extension (`limit_exceeded`): which limit stopped or cut the call, `timeout` or `output`."""
        for name in ("limit_exceeded", "limit"):
            value = self.extra(name)
            if isinstance(value, str) and value:
                return value
        return None

    @property
    def timed_out(self) -> bool:
        """sandpool extension: the call was stopped by its timeout (its return code is then 124)."""
        return self.limit == "timeout" or self.extra("timed_out") is True

    @property
    def cancelled(self) -> bool:
        """sandpool extension: a cancel stopped the call (`Session.cancel()`; return code 130)."""
        return self.extra("cancelled") is True

    @property
    def interpreter_restarted(self) -> bool:
        """sandpool extension: the Python interpreter was replaced (killed at a timeout, crashed, exited),
        so variables and imports from earlier calls are gone."""
        return self.extra("interpreter_restarted") is True

    @property
    def shell_restarted(self) -> bool:
        """sandpool extension: the persistent bash was replaced, so its cwd and variables are reset."""
        return self.extra("shell_restarted") is True

    @property
    def timeout_seconds(self) -> float | None:
        """sandpool extension: the timeout that was in force for this call."""
        value = self.extra("timeout_seconds")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @classmethod
    def from_body(cls, body: Any) -> ExecResult:
        resp = _validate(ExecResponse, body, "Execute")
        content = resp.result_block.content
        files = tuple(
            OutputFile(file_id=f.file_id, filename=f.filename, raw=f.model_dump())
            for f in (content.content or [])
        )
        return cls(
            stdout=content.stdout or "",
            stderr=content.stderr or "",
            # The contract: an explicit null return code reads the same as 0.
            return_code=content.return_code if content.return_code is not None else 0,
            files=files,
            tool_use_id=resp.tool_use_id,
            execution_time_ms=resp.execution_time_ms,
            type=resp.result_block.type,
            raw=dict(body),
        )


@dataclass(frozen=True)
class FileInfo:
    """One entry of ListFiles."""

    path: str
    size_bytes: int
    mime_type: str | None = None
    modified_at: float | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def kind(self) -> str | None:
        """sandpool extension: `file`, `directory`, `symlink` or `other` (None when the server does not say)."""
        value = self.raw.get("type")
        return value if isinstance(value, str) else None

    @property
    def is_dir(self) -> bool:
        return self.kind == "directory"


def file_infos_from_body(body: Any) -> list[FileInfo]:
    listing = _validate(FileList, body, "ListFiles")
    raws = body.get("files", []) if isinstance(body, dict) else []
    return [
        FileInfo(path=f.path, size_bytes=f.size_bytes, mime_type=f.mime_type, modified_at=f.modified_at,
                 raw=dict(raw) if isinstance(raw, dict) else {})
        for f, raw in zip(listing.files, raws, strict=True)
    ]


@dataclass(frozen=True)
class UploadResult:
    """Where PutFile stored the file and how many bytes it wrote."""

    path: str
    size_bytes: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_body(cls, body: Any) -> UploadResult:
        stored = _validate(FileUploadResult, body, "PutFile")
        return cls(path=stored.path, size_bytes=stored.size_bytes, raw=dict(body))


__all__ = ["ExecResult", "FileInfo", "OutputFile", "SessionInfo", "UploadResult", "file_infos_from_body"]
