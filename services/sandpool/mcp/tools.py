"""The MCP tools: the contract's tool kinds under their own names, plus file transfer and ending a session.

One vocabulary serves the contract and MCP: a tool's input schema is its contract
input model's, plus the optional `session_id` (and `timeout_seconds` for the tool
kinds). Arguments are checked here with the contract's own models before anything
is leased, so a bad input is a `BadInput` (a tool error the model reads), never a
protocol error.
"""

from __future__ import annotations

import base64
import binascii
import copy
import re
from dataclasses import dataclass
from typing import Any

import mcp_types as types
from pydantic import ValidationError

from sandpool.contract import (
    BASH_CODE_EXECUTION,
    CODE_EXECUTION,
    TEXT_EDITOR_CODE_EXECUTION,
    BashExecutionInput,
    CodeExecutionInput,
    TextEditorInput,
    ToolInput,
)

SESSION_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
"""The ids sandpool issues (as `sessions.service` checks them; not imported: `sandpool mcp` runs on the client
install). Anything else names no session, and never becomes part of a request path."""

UPLOAD_FILE = "upload_file"
READ_FILE = "read_file"
END_SESSION = "end_session"
KINDS = (CODE_EXECUTION, BASH_CODE_EXECUTION, TEXT_EDITOR_CODE_EXECUTION)


class BadInput(Exception):
    """A tool call's arguments do not fit the tool: answered as a tool error, with what is wrong."""


_SESSION_ID = {"type": "string", "description": "The sandpool session to run in, as an earlier result gave it. "
                                                "Omit it to start a new session (its id is in the result)."}
_TIMEOUT = {"type": "integer", "minimum": 1, "description": "Seconds the call may run (clamped to the ceiling "
                                                            "in force; the result says which limit fired)."}

DESCRIPTIONS = {
    CODE_EXECUTION: "Run Python in the session's persistent interpreter: variables, imports and files persist "
                    "across calls of one session. Figures (matplotlib's plt.show or savefig) come back as images.",
    BASH_CODE_EXECUTION: "Run a shell command in the session's workspace (its files persist across calls).",
    TEXT_EDITOR_CODE_EXECUTION: "View or edit a workspace file: view, create, str_replace, insert, undo_edit.",
    UPLOAD_FILE: "Write a file into the session's workspace, from text or base64 bytes.",
    READ_FILE: "Read a file from the session's workspace: text as text, images as images, other bytes as a "
               "resource.",
    END_SESSION: "End a session: its sandbox, interpreter state and files are destroyed.",
}


def _input_schema(model: type[Any]) -> dict[str, Any]:
    schema = copy.deepcopy(model.model_json_schema())
    schema.pop("title", None)
    schema["additionalProperties"] = False
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    return schema


def _kind_schema(model: type[Any]) -> dict[str, Any]:
    schema = _input_schema(model)
    schema["properties"] = {**schema["properties"], "session_id": _SESSION_ID, "timeout_seconds": _TIMEOUT}
    return schema


_PATH = {"type": "string", "minLength": 1, "description": "A path relative to the workspace."}

INPUT_SCHEMAS: dict[str, dict[str, Any]] = {
    CODE_EXECUTION: _kind_schema(CodeExecutionInput),
    BASH_CODE_EXECUTION: _kind_schema(BashExecutionInput),
    TEXT_EDITOR_CODE_EXECUTION: _kind_schema(TextEditorInput),
    UPLOAD_FILE: {"type": "object", "additionalProperties": False, "required": ["path"], "properties": {
        "path": _PATH, "text": {"type": "string", "description": "The file's content as text (UTF-8)."},
        "base64": {"type": "string", "description": "The file's content as base64 (instead of text)."},
        "session_id": _SESSION_ID}},
    READ_FILE: {"type": "object", "additionalProperties": False, "required": ["path"], "properties": {
        "path": _PATH, "session_id": _SESSION_ID}},
    END_SESSION: {"type": "object", "additionalProperties": False, "properties": {
        "session_id": {"type": "string", "description": "The session to end (omitted: the one this MCP "
                                                        "session uses by default, where there is one)."}}},
}

_INPUT_MODELS: dict[str, type[ToolInput]] = {
    CODE_EXECUTION: CodeExecutionInput, BASH_CODE_EXECUTION: BashExecutionInput,
    TEXT_EDITOR_CODE_EXECUTION: TextEditorInput}


def tool_list() -> list[types.Tool]:
    annotations = {
        READ_FILE: types.ToolAnnotations(read_only_hint=True, open_world_hint=False),
        END_SESSION: types.ToolAnnotations(destructive_hint=True, idempotent_hint=True, open_world_hint=False),
    }
    return [types.Tool(name=name, description=DESCRIPTIONS[name], input_schema=schema,
                       annotations=annotations.get(name, types.ToolAnnotations(open_world_hint=False)))
            for name, schema in INPUT_SCHEMAS.items()]


@dataclass(frozen=True)
class Invocation:
    """A checked tool call: which tool, the session it names (None: the default or a new one), and what to
    send: an Execute body for a tool kind, a path (and bytes) for the file tools."""

    tool: str
    session_id: str | None
    body: dict[str, Any] | None = None
    path: str = ""
    data: bytes = b""


def parse(name: str, arguments: dict[str, Any] | None) -> Invocation:
    if name not in INPUT_SCHEMAS:
        raise BadInput(f"unknown tool {name!r}; the tools are {', '.join(INPUT_SCHEMAS)}")
    args = dict(arguments or {})
    session_id = args.pop("session_id", None)
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise BadInput("session_id must be a non-empty string (omit it to start a new session)")
    if name in _INPUT_MODELS:
        timeout = args.pop("timeout_seconds", None)
        if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 1):
            raise BadInput("timeout_seconds must be a positive integer")
        try:
            checked = _INPUT_MODELS[name].model_validate(args)
        except ValidationError as exc:
            raise BadInput(_validation_text(exc)) from None
        unknown = set(args) - set(_INPUT_MODELS[name].model_fields)
        if unknown:
            raise BadInput(f"unknown argument(s): {', '.join(sorted(unknown))}")
        body: dict[str, Any] = {"tool": name, "input": checked.model_dump(exclude_none=True)}
        if timeout is not None:
            body["timeout_seconds"] = timeout
        return Invocation(name, session_id, body=body)
    allowed = set(INPUT_SCHEMAS[name]["properties"]) - {"session_id"}
    unknown = set(args) - allowed
    if unknown:
        raise BadInput(f"unknown argument(s): {', '.join(sorted(unknown))}")
    if name == END_SESSION:
        return Invocation(name, session_id)
    path = args.get("path")
    if not isinstance(path, str) or not path:
        raise BadInput("path is required: a path relative to the workspace")
    if name == READ_FILE:
        return Invocation(name, session_id, path=path)
    return Invocation(name, session_id, path=path, data=_upload_bytes(args))


def _upload_bytes(args: dict[str, Any]) -> bytes:
    text, encoded = args.get("text"), args.get("base64")
    if (text is None) == (encoded is None):
        raise BadInput("give the file's content as exactly one of text or base64")
    if text is not None:
        if not isinstance(text, str):
            raise BadInput("text must be a string")
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadInput("text is not valid Unicode") from None
    if not isinstance(encoded, str):
        raise BadInput("base64 must be a string")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise BadInput("base64 is not valid base64") from None


def well_formed_session_id(session_id: str) -> bool:
    """Whether it could be a session id at all (one that is not reads as an ended session)."""
    return SESSION_ID_PATTERN.fullmatch(session_id) is not None


def _validation_text(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_input=False, include_url=False):
        where = ".".join(str(p) for p in error.get("loc", ())) or "input"
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "invalid input: " + "; ".join(parts)


__all__ = ["END_SESSION", "KINDS", "READ_FILE", "UPLOAD_FILE", "BadInput", "Invocation", "parse", "tool_list",
           "well_formed_session_id"]
