"""Typed models of every body in contract version 1.

Requests tolerate unknown fields (the contract grows additively); responses
may carry sandpool's own extra fields, which a conforming client ignores.
The text editor's command-specific fields are validated per command, which
the contract's schema alone cannot express.

Tool kinds are declared in one place: an `ExecRequest` subclass per kind,
registered with `register_tool_kind`. `TOOL_KINDS`, `parse_exec_request` and
`result_type_for` derive from that registry (docs/agent.md, "Adding a tool kind").
"""

from __future__ import annotations

from collections.abc import KeysView, Mapping
from types import MappingProxyType
from typing import Annotated, Any, Final, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

CONTRACT_VERSION = "1"


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


class ToolInput(_Request):
    """Base of every tool kind's `input` model."""


_requests: dict[str, type[ExecRequest]] = {}
TOOL_REQUESTS: Mapping[str, type[ExecRequest]] = MappingProxyType(_requests)
"""Each registered tool kind's request model, in registration order (read-only view)."""
TOOL_KINDS: KeysView[str] = TOOL_REQUESTS.keys()
"""The registered tool kinds (a live view: a kind registered later is in it)."""

_Model = TypeVar("_Model", bound="type[ExecRequest]")


def _kind_of(model: type[ExecRequest]) -> str:
    annotation = model.model_fields["tool"].annotation
    args = get_args(annotation)
    if get_origin(annotation) is not Literal or len(args) != 1 or not isinstance(args[0], str):
        raise TypeError(f"{model.__name__}.tool must be a Literal of the one kind name it stands for")
    kind: str = args[0]
    return kind


def _build_adapter() -> TypeAdapter[ExecRequest]:
    """The discriminated union of every registered request model, keyed on `tool`."""
    union: Any = None
    for model in _requests.values():
        union = model if union is None else union | model
    if union is None:
        return TypeAdapter(ExecRequest)  # nothing registered (only while this module is imported)
    return TypeAdapter(Annotated[union, Field(discriminator="tool")])


def register_tool_kind(model: _Model) -> _Model:
    """Add a tool kind: `model` is its `ExecRequest` subclass (usable as a class decorator).

    Registration is process-wide and meant for import time; every service that parses
    Execute bodies (the api and the agent) must see the same kinds."""
    kind = _kind_of(model)
    if kind in _requests:
        raise ValueError(f"tool kind {kind!r} is already registered (by {_requests[kind].__name__})")
    _requests[kind] = model
    _forget_adapter()
    return model


def unregister_tool_kind(kind: str) -> None:
    """Remove a tool kind (tests that registered one of their own): its bodies are unknown again."""
    del _requests[kind]
    _forget_adapter()


_exec_adapter: TypeAdapter[ExecRequest] | None = None
"""Built on the first parse after the kinds changed (not once per registration at import)."""


def _forget_adapter() -> None:
    global _exec_adapter
    _exec_adapter = None


def _adapter() -> TypeAdapter[ExecRequest]:
    global _exec_adapter
    if _exec_adapter is None:
        _exec_adapter = _build_adapter()
    return _exec_adapter


class CodeExecutionInput(ToolInput):
    code: Annotated[str, Field(min_length=1)]


class BashExecutionInput(ToolInput):
    command: Annotated[str, Field(min_length=1)]


EditorCommand = Literal["view", "create", "str_replace", "insert", "undo_edit"]

_REQUIRED_BY_COMMAND: dict[str, tuple[str, ...]] = {
    "view": (),
    "create": ("file_text",),
    "str_replace": ("old_str", "new_str"),
    "insert": ("insert_line", "new_str"),
    "undo_edit": (),
}


class TextEditorInput(ToolInput):
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


class ExecRequest(_TopLevelRequest):
    """An Execute body. Each tool kind is a subclass that narrows `tool` to a one-value `Literal` (the
    kind's wire name) and `input` to its own model, registered with `register_tool_kind`."""

    timeout_seconds: TimeoutSeconds | None = None
    tool_use_id: str | None = None
    tool: str
    input: ToolInput


@register_tool_kind
class CodeExecutionRequest(ExecRequest):
    tool: Literal["code_execution"]
    input: CodeExecutionInput


@register_tool_kind
class BashExecutionRequest(ExecRequest):
    tool: Literal["bash_code_execution"]
    input: BashExecutionInput


@register_tool_kind
class TextEditorRequest(ExecRequest):
    tool: Literal["text_editor_code_execution"]
    input: TextEditorInput


# The built-in kinds' wire names, read off their request models, where each is spelled once: code that
# names a built-in kind (the client's calls, the agent's warm-up) uses these, so the kinds have one vocabulary.
CODE_EXECUTION: Final[str] = _kind_of(CodeExecutionRequest)
BASH_CODE_EXECUTION: Final[str] = _kind_of(BashExecutionRequest)
TEXT_EDITOR_CODE_EXECUTION: Final[str] = _kind_of(TextEditorRequest)


class UnknownTool(ValueError):
    """The body names a tool kind this contract version does not have (a 400, not a 422)."""

    def __init__(self, tool: object) -> None:
        super().__init__(f"unknown tool kind {tool!r}; known kinds: {', '.join(TOOL_KINDS)}")
        self.tool = tool


def parse_exec_request(body: object) -> ExecRequest:
    """Validate an Execute body as the request model of its tool kind.

    Raises `UnknownTool` for a string `tool` that names no registered kind, and
    pydantic's `ValidationError` for anything else malformed (locations start
    with the kind, as a discriminated union reports them).
    """
    if isinstance(body, dict):
        tool = body.get("tool")
        if isinstance(tool, str) and tool not in _requests:
            raise UnknownTool(tool)
    adapter = _exec_adapter
    if adapter is None:
        adapter = _adapter()
    return adapter.validate_python(body)


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
    """Fields in the order the agent sends them (its body is this model's JSON; extras follow)."""

    tool_use_id: str
    execution_time_ms: Annotated[int, Field(ge=0)] | None = None
    result_block: ResultBlock


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
