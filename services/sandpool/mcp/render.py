"""Contract answers as MCP content an LLM client uses directly.

An Execute becomes one text block (stdout, stderr, the return code, which limit fired,
the session id) and one block per produced file: images (a matplotlib figure) as image
content, so the model sees the plot; other files as embedded resources, text or bytes,
addressed `sandpool://sessions/<id>/files/<path>`. The same facts are the structured
content, for clients that read JSON.
"""

from __future__ import annotations

import base64
import mimetypes
from typing import Any
from urllib.parse import quote

import mcp_types as types

IMAGE_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp", "image/svg+xml"})
MAX_FILES = 8
"""Produced files fetched into one result; the rest are named in the text only."""
MAX_FILE_BYTES = 4 * 1024 * 1024
"""A produced file larger than this is named, not embedded (read_file fetches it)."""


def file_uri(session_id: str, path: str) -> str:
    return f"sandpool://sessions/{quote(session_id, safe='')}/files/{quote(path, safe='/')}"


def mime_of(path: str) -> str:
    return mimetypes.guess_type(path)[0] or "application/octet-stream"


def produced_files(body: dict[str, Any]) -> list[str]:
    """The workspace paths (the contract's `file_id`s) an Execute produced."""
    content = body.get("result_block", {}).get("content", {})
    files = content.get("content") if isinstance(content, dict) else None
    return [f["file_id"] for f in files or () if isinstance(f, dict) and isinstance(f.get("file_id"), str)]


def exec_facts(body: dict[str, Any], session_id: str, *, new_session: bool) -> dict[str, Any]:
    """The structured content of an Execute: the result's fields a model needs, and the session."""
    content = body.get("result_block", {}).get("content", {})
    content = content if isinstance(content, dict) else {}
    limit = content.get("limit_exceeded") or body.get("limit_exceeded")
    facts: dict[str, Any] = {
        "session_id": session_id, "new_session": new_session,
        "stdout": content.get("stdout") or "", "stderr": content.get("stderr") or "",
        "return_code": content.get("return_code") if isinstance(content.get("return_code"), int) else 0,
        "limit_exceeded": limit if isinstance(limit, str) and limit else None,
        "files": produced_files(body),
    }
    for extra in ("timed_out", "cancelled", "interpreter_restarted", "shell_restarted", "timeout_seconds"):
        value = content.get(extra, body.get(extra))
        if value is not None:
            facts[extra] = value
    if isinstance(body.get("execution_time_ms"), int):
        facts["execution_time_ms"] = body["execution_time_ms"]
    return facts


def exec_text(facts: dict[str, Any]) -> str:
    lines = [session_line(facts["session_id"], facts["new_session"])]
    if facts["stdout"]:
        lines.append("stdout:\n" + facts["stdout"].rstrip("\n"))
    if facts["stderr"]:
        lines.append("stderr:\n" + facts["stderr"].rstrip("\n"))
    lines.append(f"return code: {facts['return_code']}")
    if facts["limit_exceeded"]:
        lines.append(f"limit fired: {facts['limit_exceeded']}"
                     + (f" (timeout {facts['timeout_seconds']} s)" if facts["limit_exceeded"] == "timeout"
                        and "timeout_seconds" in facts else ""))
    if facts.get("cancelled"):
        lines.append("the call was cancelled")
    if facts.get("interpreter_restarted"):
        lines.append("the Python interpreter was restarted: earlier variables and imports are gone")
    if facts["files"]:
        lines.append("files produced: " + ", ".join(facts["files"]))
    return "\n".join(lines)


def session_line(session_id: str, new_session: bool) -> str:
    if new_session:
        return f"session_id: {session_id} (a new session: pass this session_id to later calls to keep its state)"
    return f"session_id: {session_id}"


def file_block(session_id: str, path: str, data: bytes) -> types.ContentBlock:
    """A file as content: an image as image content, text as a text resource, other bytes as a blob resource."""
    mime = mime_of(path)
    if mime in IMAGE_TYPES:
        return types.ImageContent(type="image", data=base64.b64encode(data).decode("ascii"), mime_type=mime)
    uri = file_uri(session_id, path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        blob = types.BlobResourceContents(uri=uri, mime_type=mime, blob=base64.b64encode(data).decode("ascii"))
        return types.EmbeddedResource(type="resource", resource=blob)
    if mime == "application/octet-stream":
        mime = "text/plain"
    return types.EmbeddedResource(type="resource", resource=types.TextResourceContents(uri=uri, mime_type=mime,
                                                                                      text=text))


def text(value: str) -> types.TextContent:
    return types.TextContent(type="text", text=value)


def failure(message: str, **structured: Any) -> types.CallToolResult:
    """A tool error: the model reads what went wrong (never a protocol error)."""
    return types.CallToolResult(content=[text(message)], is_error=True,
                                structured_content={"error": message, **structured})


__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "exec_facts", "exec_text", "failure", "file_block", "file_uri",
           "mime_of", "produced_files", "session_line", "text"]
