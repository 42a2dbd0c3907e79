"""Typed models of every body in contract version 1.

Requests tolerate unknown fields (the contract grows additively); responses
may carry sandpool's own extra fields, which a conforming client ignores.
The text editor's command-specific fields are validated per command, which
the contract's schema alone cannot express.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

CONTRACT_VERSION = "1"

TOOL_KINDS = ("code_execution", "bash_code_execution", "text_editor_code_execution")


def result_type_for(tool: str) -> str:
    """The result block `type` for a tool kind: `<kind>_tool_result`."""
    return f"{tool}_tool_result"


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


def _not_unicode(value: Any) -> bool:
    """True when some string in a parsed JSON document holds a lone surrogate (JSON allows the
    escape `\\ud800`, but such text cannot be encoded as UTF-8, so it could never be echoed,
    forwarded or written without a 500)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_not_unicode(k) or _not_unicode(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_not_unicode(v) for v in value)
    return False


class _TopLevelRequest(_Request):
    """A whole request body: every string in it, extra fields included, must be Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        if _not_unicode(data):
            raise ValueError("text must be valid Unicode: a lone surrogate cannot be encoded as UTF-8")
        return data


# --- CreateSession ---------------------------------------------------------------------------


class CreateSessionRequest(_TopLevelRequest):
    """Lifetime hints, both optional; the backend clamps them to its ceilings."""

    idle_timeout_seconds: Annotated[int, Field(ge=1)] | None = None
    max_lifetime_seconds: Annotated[int, Field(ge=1)] | None = None
    image: str | None = Field(default=None, description="sandpool extension: which pool's image to lease from")


class SessionHandle(_Response):
    session_id: Annotated[str, Field(min_length=1)]
    idle_timeout_seconds: int | None = None
    max_lifetime_seconds: int | None = None
    created_at: float | None = None
    last_activity_at: float | None = None


class SessionDetails(SessionHandle):
    """The handle as sandpool serves it (CreateSession, GetSession, the admin's session list): the
    contract's fields and sandpool's. Clients validate with `SessionHandle`, which any backend meets."""

    image: str | None = Field(default=None, description="The image of the pool the sandbox came from")
    pool: str | None = Field(default=None, description="The pool the sandbox came from")
    exec_timeout_seconds: int | None = Field(default=None, description="The timeout of an Execute that names none")
    max_exec_timeout_seconds: int | None = Field(default=None, description="The most an Execute may ask for")
    limits: dict[str, int] | None = Field(default=None, description="The workspace's lease limits it was leased under")
    deadline: float | None = Field(default=None, description="When the session reaper ends it (epoch seconds)")
    workspace: str | None = Field(default=None, description="The workspace it belongs to")


# --- Execute ---------------------------------------------------------------------------------

TimeoutSeconds = Annotated[int, Field(ge=1)]


class CodeExecutionInput(_Request):
    code: Annotated[str, Field(min_length=1)]


class BashExecutionInput(_Request):
    command: Annotated[str, Field(min_length=1)]


EditorCommand = Literal["view", "create", "str_replace", "insert", "undo_edit"]

_REQUIRED_BY_COMMAND: dict[str, tuple[str, ...]] = {
    "view": (),
    "create": ("file_text",),
    "str_replace": ("old_str", "new_str"),
    "insert": ("insert_line", "new_str"),
    "undo_edit": (),
}


class TextEditorInput(_Request):
    command: EditorCommand
    path: Annotated[str, Field(min_length=1)]
    file_text: str | None = None
    old_str: str | None = None
    new_str: str | None = None
    insert_line: int | None = None
    view_range: Annotated[list[int], Field(min_length=2, max_length=2)] | None = None

    @model_validator(mode="after")
    def _fields_for_command(self) -> TextEditorInput:
        missing = [f for f in _REQUIRED_BY_COMMAND[self.command] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"command {self.command!r} requires {', '.join(missing)}")
        return self


class _ExecBase(_TopLevelRequest):
    timeout_seconds: TimeoutSeconds | None = None
    tool_use_id: str | None = None


class CodeExecutionRequest(_ExecBase):
    tool: Literal["code_execution"]
    input: CodeExecutionInput


class BashExecutionRequest(_ExecBase):
    tool: Literal["bash_code_execution"]
    input: BashExecutionInput


class TextEditorRequest(_ExecBase):
    tool: Literal["text_editor_code_execution"]
    input: TextEditorInput


ExecRequest = Annotated[
    CodeExecutionRequest | BashExecutionRequest | TextEditorRequest,
    Field(discriminator="tool"),
]
_exec_adapter: TypeAdapter[CodeExecutionRequest | BashExecutionRequest | TextEditorRequest] = TypeAdapter(ExecRequest)


class UnknownTool(ValueError):
    """The body names a tool kind this contract version does not have (a 400, not a 422)."""

    def __init__(self, tool: object) -> None:
        super().__init__(f"unknown tool kind {tool!r}; known kinds: {', '.join(TOOL_KINDS)}")
        self.tool = tool


def parse_exec_request(body: object) -> CodeExecutionRequest | BashExecutionRequest | TextEditorRequest:
    """Validate an Execute body.

    Raises `UnknownTool` for a string `tool` that names no known kind, and
    pydantic's `ValidationError` for anything else malformed.
    """
    if isinstance(body, dict):
        tool = body.get("tool")
        if isinstance(tool, str) and tool not in TOOL_KINDS:
            raise UnknownTool(tool)
    return _exec_adapter.validate_python(body)


class CodeExecutionOutputFile(_Response):
    type: Literal["code_execution_output"] = "code_execution_output"
    file_id: str
    filename: str


class CodeExecutionResult(_Response):
    type: Literal["code_execution_result"] = "code_execution_result"
    stdout: str | None = ""
    stderr: str | None = ""
    return_code: int | None = 0
    content: list[CodeExecutionOutputFile] | None = Field(default_factory=list)


class ResultBlock(_Response):
    type: Annotated[str, Field(min_length=1)]
    tool_use_id: str
    content: CodeExecutionResult


class ExecResponse(_Response):
    tool_use_id: str
    result_block: ResultBlock
    execution_time_ms: Annotated[int, Field(ge=0)] | None = None


# --- Files -----------------------------------------------------------------------------------


class FileMetadata(_Response):
    path: str
    size_bytes: Annotated[int, Field(ge=0)]
    mime_type: str | None = None
    modified_at: float | None = None


class FileList(_Response):
    files: list[FileMetadata]


class FileEntry(FileMetadata):
    """A ListFiles entry as sandpool serves it: the contract's fields and what kind of entry it is."""

    type: Literal["file", "directory", "symlink", "other"]


class FileListing(FileList):
    """ListFiles as sandpool serves it; `truncated`: more entries than one answer lists."""

    files: list[FileEntry]  # type: ignore[assignment]  # narrower than the contract's list, as a subclass may be
    truncated: bool = False


class FileUploadResult(_Response):
    path: str
    size_bytes: Annotated[int, Field(ge=0)]


class ErrorBody(_Response):
    """Informational; clients must not depend on it. sandpool adds a stable `reason`."""

    detail: Any = None
    reason: str | None = None


__all__ = ["ValidationError"]
