"""The streamable HTTP transport of `/mcp`: the official `mcp` SDK's session manager, both revisions.

- The current revision (an `MCP-Protocol-Version: 2026-07-28` header) is stateless: the SDK
  serves each POST on its own, no handshake, no MCP session; a call names its session or
  leases one.
- The previous revision (2025-11-25, and the handshake revisions before it) gets an
  `Mcp-Session-Id` that lives in Redis (`state.mcp_sessions`), bound to the workspace that
  opened it, so any api replica serves its next request. The SDK serves each POST
  statelessly; this module issues the id on `initialize`, checks it on every request
  (another workspace's id reads as an unknown one: 404), deletes it on DELETE (releasing
  its default sandpool session), and turns a `notifications/cancelled` into a
  CancelExecution of the call it names, whichever replica runs that call.

Tool calls reach the contract in process (`sandpool.mcp.inprocess`) with the caller's own
`Authorization`, so tenancy, policy, rate, quotas, budgets and metering are the contract's,
applied by the contract's code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

from mcp.server.context import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Send

from sandpool.core.errors import SandpoolError, StateStoreUnavailable, error_response
from sandpool.mcp.backend import CallRefused
from sandpool.mcp.caller import CALLER_KEY, McpCaller
from sandpool.mcp.inprocess import InProcessBackend
from sandpool.mcp.server import Binding, build_server
from sandpool.sessions.service import read_capped
from sandpool.state import Client, Keys, StateError
from sandpool.state.mcp_sessions import McpSessionStore

log = logging.getLogger(__name__)

SESSION_HEADER = "mcp-session-id"
VERSION_HEADER = "mcp-protocol-version"
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""A JSON-RPC message's cap (an upload's base64 rides in one; the contract's own upload cap applies after)."""


class RedisDefault:
    """An MCP session's default sandpool session, in Redis (any replica serves it). A Redis failure is the
    tool call's refusal (503), as the contract answers it."""

    def __init__(self, store: McpSessionStore, mcp_session_id: str, workspace: str) -> None:
        self.store, self.mcp_session_id, self.workspace = store, mcp_session_id, workspace

    async def get(self) -> str | None:
        with _refused_when_redis_fails():
            found = await self.store.lookup(self.mcp_session_id, self.workspace)
        return found.session if found is not None and found.session else None

    async def bind(self, session_id: str) -> str | None:
        with _refused_when_redis_fails():
            return await self.store.bind(self.mcp_session_id, self.workspace, session_id)

    async def forget(self, session_id: str) -> None:
        with _refused_when_redis_fails():
            await self.store.unbind(self.mcp_session_id, self.workspace, session_id)

    async def running(self, request_id: str, session_id: str) -> None:
        with _refused_when_redis_fails():
            await self.store.running(self.mcp_session_id, request_id, session_id)

    async def finished(self, request_id: str) -> None:
        try:
            await self.store.finished(self.mcp_session_id, request_id)
        except StateError:
            pass  # (the record expires on its own; a cancel for a finished call finds nothing to stop)


@contextlib.contextmanager
def _refused_when_redis_fails() -> Iterator[None]:
    try:
        yield
    except StateError:
        raise CallRefused(503, "state store unavailable; retry later", reason="redis_unavailable",
                          retry_after="1") from None


class Served:
    """The SDK's session manager (stateless: the MCP sessions are in Redis) and the requests it serves."""

    def __init__(self, contract: ASGIApp, keys: Keys, redis: Client) -> None:
        self.contract = contract
        self.store = McpSessionStore(redis, keys)
        self.manager = StreamableHTTPSessionManager(build_server(self._binding), stateless=True,
                                                    max_request_body_size=MAX_MESSAGE_BYTES)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Run the session manager in a task of its own until `stop` (it needs a task group that outlives requests)."""
        running = asyncio.get_running_loop().create_future()

        async def run() -> None:
            async with self.manager.run():
                running.set_result(None)
                await self._stop.wait()

        def ended(task: asyncio.Task[None]) -> None:
            if not running.done():  # it ended before it ran: say why to whoever waits for it
                failed = None if task.cancelled() else task.exception()
                running.set_exception(failed or RuntimeError("the MCP session manager did not start"))

        self._task = asyncio.create_task(run(), name="sandpool-mcp")
        self._task.add_done_callback(ended)
        await running

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    # --- the tool handlers' view of the request -----------------------------------------------

    def _binding(self, ctx: ServerRequestContext[Any, Any]) -> Binding:
        request = ctx.request
        assert isinstance(request, Request), "the streamable HTTP transport hands each call its request"
        caller: McpCaller = request.scope[CALLER_KEY]
        default = None
        if caller.mcp_session_id is not None:
            default = RedisDefault(self.store, caller.mcp_session_id, caller.workspace)
        return Binding(self._backend(request, caller), default)

    def _backend(self, request: Request, caller: McpCaller) -> InProcessBackend:
        return InProcessBackend(self.contract, request.scope["app"], authorization=caller.authorization,
                                request_id=caller.request_id, client=caller.client)

    # --- HTTP ---------------------------------------------------------------------------------

    async def handle(self, request: Request, caller: McpCaller, send: Send) -> None:
        scope, receive = request.scope, request.receive
        version = request.headers.get(VERSION_HEADER)
        if version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS:
            scope[CALLER_KEY] = caller  # the current revision: stateless, no MCP session
            await self.manager.handle_request(scope, receive, send)
            return
        try:
            await self._previous_revision(request, caller, send)
        except SandpoolError as exc:
            await error_response(exc)(scope, receive, send)
        except StateError:
            await error_response(StateStoreUnavailable("state store unavailable; retry later",
                                                       retry_after=1))(scope, receive, send)

    async def _previous_revision(self, request: Request, caller: McpCaller, send: Send) -> None:
        scope, receive = request.scope, request.receive
        mcp_id = request.headers.get(SESSION_HEADER)
        if request.method == "DELETE":
            await self._delete(request, caller, mcp_id, send)
            return
        if request.method != "POST":  # no standalone stream: nothing is ever sent outside a request's own answer
            await Response(status_code=405, headers={"Allow": "POST, DELETE"})(scope, receive, send)
            return
        body = await read_capped(request, MAX_MESSAGE_BYTES)
        message = _decoded(body)
        if mcp_id is not None:
            if await self.store.lookup(mcp_id, caller.workspace) is None:
                await _session_not_found(request, send)
                return
        elif isinstance(message, dict) and message.get("method") == "initialize" and "id" in message:
            mcp_id = (await self.store.open(caller.workspace)).id
        if mcp_id is not None and _is_cancel(message):
            await self._cancel(self._backend(request, caller), mcp_id, message)
            await Response(status_code=202, headers={SESSION_HEADER: mcp_id})(scope, receive, send)
            return
        scope[CALLER_KEY] = McpCaller(caller.workspace, caller.authorization, mcp_id, caller.request_id,
                                      caller.client)
        await self.manager.handle_request(scope, _replayed(body, receive), _with_session_id(send, mcp_id))

    async def _delete(self, request: Request, caller: McpCaller, mcp_id: str | None, send: Send) -> None:
        if not mcp_id:
            await JSONResponse(_rpc_error("Bad Request: Missing session ID"), status_code=400)(
                request.scope, request.receive, send)
            return
        closed = await self.store.close(mcp_id, caller.workspace)
        if closed is None:
            await _session_not_found(request, send)
            return
        if closed.session:
            try:
                await self._backend(request, caller).destroy_session(closed.session)
            except CallRefused as refused:  # (Redis failed: the session's idle timeout reaps it anyway)
                log.warning("an MCP session's sandpool session was not released", extra={"status": refused.status})
        await Response(status_code=200)(request.scope, request.receive, send)

    async def _cancel(self, backend: InProcessBackend, mcp_id: str, message: dict[str, Any]) -> None:
        """A cancel notification: stop the call it names, wherever it runs (as its session's running call)."""
        params = message.get("params")
        request_id = params.get("requestId") if isinstance(params, dict) else None
        if request_id is None:
            return
        session = await self.store.running_in(mcp_id, str(request_id))
        if session is None:
            return  # finished already, or never ran
        try:
            await backend.cancel(session)
        except CallRefused as refused:
            log.info("an MCP cancel found nothing to stop", extra={"status": refused.status,
                                                                   "reason": refused.reason})
        else:
            log.info("an MCP call cancelled", extra={"session": session})


def _decoded(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None  # (the SDK answers the parse error)


def _is_cancel(message: Any) -> bool:
    return isinstance(message, dict) and message.get("method") == "notifications/cancelled" and "id" not in message


def _rpc_error(message: str, code: int = -32600) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}}


async def _session_not_found(request: Request, send: Send) -> None:
    """The one answer for an unknown, expired, deleted, or another workspace's `Mcp-Session-Id`."""
    await JSONResponse(_rpc_error("Session not found"), status_code=404)(request.scope, request.receive, send)


def _replayed(body: bytes, receive: Receive) -> Receive:
    """The request's body again (it was read here), then the client's own events (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_session_id(send: Send, mcp_id: str | None) -> Send:
    if mcp_id is None:
        return send

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != SESSION_HEADER.encode()]
            message = {**message, "headers": [*headers, (SESSION_HEADER.encode(), mcp_id.encode())]}
        await send(message)

    return sending


__all__ = ["Served"]
