"""The MCP server: sandpool's tools on the official SDK's low-level `Server`, for any transport.

`build_server(resolve)` answers `tools/list` and `tools/call`; `resolve(ctx)` gives each
call its `Binding`: the backend that reaches the contract for this caller and, for a
client of the previous revision, its MCP session's default sandpool session. A tool call
without `session_id` uses that default, or leases a new session whose id the result
carries. Output streams out as progress notifications (sent only when the client gave a
progress token); every failure is a tool error, never a protocol error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server

from sandpool import __version__
from sandpool.mcp import render
from sandpool.mcp.backend import Backend, CallRefused, SessionGone
from sandpool.mcp.tools import (
    END_SESSION,
    INPUT_SCHEMAS,
    READ_FILE,
    UPLOAD_FILE,
    BadInput,
    Invocation,
    parse,
    tool_list,
    well_formed_session_id,
)

log = logging.getLogger(__name__)

PROGRESS_TEXT_CHARS = 4000
"""The most output one progress notification carries (a long write is split)."""
INSTRUCTIONS = ("sandpool runs code in isolated sandboxes. A call without session_id starts a new session and "
                "returns its session_id; pass it to later calls to keep interpreter state and files. "
                "End a session with end_session when done.")


class DefaultSession(Protocol):
    """The sandpool session an MCP session (previous revision: `Mcp-Session-Id`) uses when a call names none."""

    async def get(self) -> str | None: ...

    async def bind(self, session_id: str) -> str | None:
        """Bind a freshly leased session unless another call bound one first: the one bound."""
        ...

    async def forget(self, session_id: str) -> None:
        """The bound session ended: the next call leases anew."""
        ...

    async def running(self, request_id: str, session_id: str) -> None: ...

    async def finished(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class Binding:
    backend: Backend
    default: DefaultSession | None = None


Resolve = Callable[[ServerRequestContext[Any, Any]], Binding]


class NoSession(Exception):
    """A call that must name a session and does not."""


class ToolRunner:
    """One tool call, from its arguments to its MCP result."""

    async def call(self, name: str, arguments: dict[str, Any] | None, binding: Binding, *, request_id: str = "",
                   progress: Callable[[float, str], Any] | None = None) -> types.CallToolResult:
        try:
            invocation = parse(name, arguments)
        except BadInput as exc:
            return render.failure(str(exc))
        session_id, new = "", False
        try:
            if invocation.tool == END_SESSION:
                return await self._end(invocation, binding)
            session_id, new = await self._session(invocation, binding)
            if binding.default is not None and request_id:
                await binding.default.running(request_id, session_id)
            try:
                return await self._run(invocation, session_id, new, binding.backend, progress)
            finally:
                if binding.default is not None and request_id:
                    with anyio.CancelScope(shield=True):  # (also when the call was cancelled)
                        await binding.default.finished(request_id)
        except SessionGone as gone:
            if binding.default is not None and invocation.session_id is None and session_id:
                await binding.default.forget(session_id)
            return render.failure(
                f"session {session_id or invocation.session_id} has ended or does not exist ({gone.detail}): its "
                "state and files are gone. Call again without session_id to start a new session.",
                session_id=session_id or invocation.session_id, ended=True)
        except CallRefused as refused:
            return render.failure(_refusal_text(refused), **({"session_id": session_id} if session_id else {}),
                                  status=refused.status, reason=refused.reason)
        except NoSession as exc:
            return render.failure(str(exc))

    async def _session(self, invocation: Invocation, binding: Binding) -> tuple[str, bool]:
        """The session to run in and whether it was leased for this call."""
        if invocation.session_id is not None:
            if not well_formed_session_id(invocation.session_id):
                raise SessionGone(404, "session not found")
            return invocation.session_id, False
        default = binding.default
        if default is not None:
            bound = await default.get()
            if bound:
                return bound, False
        created = await binding.backend.create_session()
        if default is None:
            return created, True
        winner = await default.bind(created)
        if winner is None or winner == created:
            return created, True
        await binding.backend.destroy_session(created)  # another call of this MCP session leased first
        return winner, False

    async def _run(self, invocation: Invocation, session_id: str, new: bool, backend: Backend,
                   progress: Callable[[float, str], Any] | None) -> types.CallToolResult:
        if invocation.tool == UPLOAD_FILE:
            stored = await backend.put_file(session_id, invocation.path, invocation.data)
            size = stored.get("size_bytes", len(invocation.data))
            path = stored.get("path", invocation.path)
            message = f"{render.session_line(session_id, new)}\nwrote {path} ({size} bytes)"
            return types.CallToolResult(content=[render.text(message)], structured_content={
                "session_id": session_id, "new_session": new, "path": path, "size_bytes": size})
        if invocation.tool == READ_FILE:
            data = await backend.get_file(session_id, invocation.path)
            message = f"{render.session_line(session_id, new)}\n{invocation.path}: {len(data)} bytes"
            return types.CallToolResult(
                content=[render.text(message), render.file_block(session_id, invocation.path, data)],
                structured_content={"session_id": session_id, "new_session": new, "path": invocation.path,
                                    "size_bytes": len(data), "mime_type": render.mime_of(invocation.path)})
        assert invocation.body is not None
        sent = Progress(progress)
        body = await backend.execute(session_id, invocation.body, sent.output if progress is not None else None)
        facts = render.exec_facts(body, session_id, new_session=new)
        blocks: list[types.ContentBlock] = []
        notes: list[str] = []
        for path in facts["files"][:render.MAX_FILES]:
            try:
                data = await backend.get_file(session_id, path)
            except SessionGone:
                raise
            except CallRefused as refused:
                notes.append(f"{path}: not fetched ({refused.detail})")
                continue
            if len(data) > render.MAX_FILE_BYTES:
                notes.append(f"{path}: {len(data)} bytes, not embedded (read it with read_file)")
                continue
            blocks.append(render.file_block(session_id, path, data))
        message = render.exec_text(facts) + "".join("\n" + note for note in notes)
        return types.CallToolResult(content=[render.text(message), *blocks], structured_content=facts)

    async def _end(self, invocation: Invocation, binding: Binding) -> types.CallToolResult:
        default = binding.default
        session_id = invocation.session_id
        if session_id is None and default is not None:
            session_id = await default.get()
        if not session_id:
            raise NoSession("name the session_id to end (no session is in use by default here)")
        await binding.backend.destroy_session(session_id)
        if default is not None:
            await default.forget(session_id)
        return types.CallToolResult(content=[render.text(f"session {session_id} ended")],
                                    structured_content={"session_id": session_id, "ended": True})


class Progress:
    """A streamed call's output as progress notifications: progress counts the characters sent so far."""

    def __init__(self, send: Callable[[float, str], Any] | None) -> None:
        self.send = send
        self.sent = 0

    async def output(self, stream: str, text: str) -> None:
        if self.send is None:
            return
        for start in range(0, len(text), PROGRESS_TEXT_CHARS):
            piece = text[start:start + PROGRESS_TEXT_CHARS]
            self.sent += len(piece)
            await self.send(float(self.sent), f"{stream}: {piece}")


def _refusal_text(refused: CallRefused) -> str:
    text = f"sandpool could not run the call ({refused.status}"
    text += f" {refused.reason})" if refused.reason else ")"
    text += f": {refused.detail}"
    if refused.retry_after:
        text += f"; retry after {refused.retry_after} s"
    return text


def build_server(resolve: Resolve) -> Server[Any]:
    """The low-level MCP server of sandpool's tools; `resolve` binds each call to its caller's backend."""
    runner = ToolRunner()

    async def list_tools(ctx: ServerRequestContext[Any, Any],
                         params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=tool_list())

    async def call_tool(ctx: ServerRequestContext[Any, Any],
                        params: types.CallToolRequestParams) -> types.CallToolResult:
        binding = resolve(ctx)

        async def progress(value: float, message: str) -> None:
            await ctx.session.report_progress(value, None, message)

        request_id = "" if ctx.request_id is None else str(ctx.request_id)
        return await runner.call(params.name, params.arguments, binding, request_id=request_id, progress=progress)

    # (The tools' schemas are fixed: the SDK checks a call's `Mcp-Param-*` headers against them without listing.)
    return Server("sandpool", version=__version__, instructions=INSTRUCTIONS, on_list_tools=list_tools,
                  on_call_tool=call_tool, get_tool_input_schema=INPUT_SCHEMAS.get)


__all__ = ["Binding", "DefaultSession", "Resolve", "ToolRunner", "build_server"]
