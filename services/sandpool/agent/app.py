"""The agent's HTTP application: the contract's session-scoped paths, for the one session it serves.

`create_app(settings, secret)` builds it; importing this module does nothing
else, so a template process can import it once and fork agents from it (and
build `routes_app()`, the FastAPI app of the routes that is the same for every
agent, before it forks). The lifespan starts (and warms) the interpreter and
the shell before the first request is served, and kills every child when it
ends. Execute, every call's path, is served straight from ASGI (`AgentApp`).
The first session id an authenticated call names is the only one served
(`agent.fence`): a call for another is refused and the agent ends.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import mimetypes
import os
import secrets
import stat
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import parse_qs, quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandpool.agent import produced, streaming, tools
from sandpool.agent.auth import BearerSecretMiddleware
from sandpool.agent.calls import Withdrawn
from sandpool.agent.execution import ChildStartFailed, OutputListener
from sandpool.agent.fence import Fence, session_of
from sandpool.agent.limits import BodyLimitMiddleware
from sandpool.agent.runtime import Runtime
from sandpool.agent.settings import AgentSettings
from sandpool.agent.workspace import shown
from sandpool.contract.agent_protocol import (
    CALL_ID_HEADER,
    FENCED_HEADER,
    FENCED_STATUS,
    OUTCOME_HEADER,
    Outcome,
    lower_name,
)
from sandpool.contract.models import (
    CODE_EXECUTION,
    CodeExecutionOutputFile,
    CodeExecutionResult,
    ExecRequest,
    ExecResponse,
    FileEntry,
    FileListing,
    FileUploadResult,
    ResultBlock,
    UnknownTool,
    parse_exec_request,
    result_type_for,
)
from sandpool.contract.reasons import Reason
from sandpool.core.errors import (
    Invalid,
    NoRunningCall,
    NotFound,
    SandpoolError,
    Unavailable,
    UnknownToolKind,
    error_response,
    install_error_handlers,
)
from sandpool.core.request_ids import ACCESS_EXTRA_KEY, RequestIdMiddleware
from sandpool.core.responses import ModelResponse

log = logging.getLogger("sandpool.agent")

RUNTIME_KEY = "sandpool.runtime"  # where a request finds the agent's runtime in its ASGI scope
_CALL_ID = lower_name(CALL_ID_HEADER)
WITHDRAWN_CODE = 130
"""The return code of a call withdrawn before it ran: a cancelled call's (128 + SIGINT)."""
_LIST_LIMIT = 10_000
_READ_CHUNK = 1 << 20
_EXEC_RESPONSE: TypeAdapter[ExecResponse] = TypeAdapter(ExecResponse)


def _validation_errors(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()]


@functools.cache
def routes_app() -> FastAPI:
    """The FastAPI app of every route, the same for every agent: no secret, settings or runtime in it
    (a request finds its runtime in its scope). Built once per process: the zygote builds it before
    it forks, so a sandbox inherits it ready instead of spending ~8 ms on route set-up."""
    app = FastAPI(title="sandpool agent", redirect_slashes=False, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/sessions/{session_id}/exec")
    async def execute(session_id: str, request: Request) -> Response:
        return await exec_call(rt(request), await request.body(), request.scope)

    @app.delete("/sessions/{session_id}/exec")
    async def cancel(session_id: str, request: Request, call_id: str | None = None) -> Response:
        return await cancel_call(rt(request), call_id)

    @app.get("/sessions/{session_id}/files/list")
    async def list_files(session_id: str, request: Request, path: str = ".") -> Response:
        runtime = rt(request)
        async with runtime.lock:
            return ModelResponse(await run_in_threadpool(_list_dir, runtime, path))

    @app.get("/sessions/{session_id}/files")
    async def get_file(session_id: str, request: Request, path: str) -> Response:
        runtime = rt(request)
        async with runtime.lock:
            fd, st = await run_in_threadpool(runtime.workspace.open_file, path,
                                             max_bytes=runtime.settings.max_read_bytes)
        media_type = mimetypes.guess_type(path)[0] or "application/octet-stream"
        filename = quote(os.path.basename(path), safe="")
        return StreamingResponse(_stream_fd(fd, st.st_size), media_type=media_type,
                                 headers={"Content-Length": str(st.st_size),
                                          "Content-Disposition": f"attachment; filename*=UTF-8''{filename}"})

    @app.post("/sessions/{session_id}/files", status_code=201)
    async def put_file(session_id: str, request: Request) -> Response:
        runtime = rt(request)
        form = await request.form(max_files=1, max_fields=4)
        try:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise Invalid("multipart field 'file' is required")
            target = form.get("path")
            if target is not None and not isinstance(target, str):
                raise Invalid("multipart field 'path' must be text")
            if target is None:
                target = os.path.basename(upload.filename or "")
                if not target:
                    raise Invalid("no 'path' given and the upload has no file name")
            async with runtime.lock:
                rel, size = await run_in_threadpool(runtime.workspace.write, target, _chunks(upload.file),
                                                    max_bytes=runtime.settings.max_upload_bytes)
        finally:
            await form.close()
        return ModelResponse(FileUploadResult(path=rel, size_bytes=size), status_code=201)

    return app


def rt(request: Request) -> Runtime:
    return request.scope[RUNTIME_KEY]


@dataclass(frozen=True)
class ExecCall:
    """A parsed Execute: the call, the tool that runs it, its correlation id, the timeout in force, and the
    id a cancel names it by."""

    call: ExecRequest
    tool: tools.AnyTool
    tool_use_id: str
    timeout: float
    call_id: str

    @property
    def streamable(self) -> bool:
        """Whether the tool streams its output (code and bash do; the editor answers its one JSON body)."""
        return self.tool.streams


def parse_exec(runtime: Runtime, raw: bytes, scope: Scope) -> ExecCall | Response:
    """The call in an Execute body, or the 422 answer to a malformed one (other refusals raise)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise Invalid("request body is not JSON") from None
    try:
        call = parse_exec_request(body)
    except UnknownTool as exc:
        raise UnknownToolKind(str(exc)) from None
    except ValidationError as exc:
        return JSONResponse({"detail": _validation_errors(exc), "reason": Reason.INVALID_REQUEST}, status_code=422)
    tool = tools.get(call.tool)
    if tool is None:  # a contract kind this agent does not serve
        raise UnknownToolKind(f"tool kind {call.tool!r} is not served by this agent")
    given = next((v.decode("latin-1") for k, v in scope["headers"] if k == _CALL_ID), None)
    return ExecCall(call, tool, call.tool_use_id or "srvtoolu_" + secrets.token_hex(12),
                    runtime.clamp_timeout(call.timeout_seconds), runtime.calls.name(given))


async def exec_call(runtime: Runtime, raw: bytes, scope: Scope) -> Response:
    """Execute: one tool call, answered with the contract's result (both paths run this)."""
    parsed = parse_exec(runtime, raw, scope)
    if isinstance(parsed, Response):
        return parsed
    return await answer(runtime, parsed, scope)


async def answer(runtime: Runtime, parsed: ExecCall, scope: Scope) -> Response:
    """Run a parsed call; its result as the one JSON body (with the outcome header for the api)."""
    response, outcome_label = await run_call(runtime, parsed, scope)
    return Response(exec_body(response), media_type="application/json", headers={OUTCOME_HEADER: outcome_label})


def exec_body(response: ExecResponse) -> bytes:
    """The JSON body of an Execute answer: a streamed call's `result` event carries the same bytes."""
    return _EXEC_RESPONSE.dump_json(response)


async def run_call(runtime: Runtime, parsed: ExecCall, scope: Scope,
                   on_output: OutputListener | None = None) -> tuple[ExecResponse, str]:
    """Run one call under the session's lock with the tool its kind names: the contract's response
    and the outcome label. `on_output` sees the output the result keeps, as it arrives (a streamed call)."""
    try:
        return await _run_in_turn(runtime, parsed, scope, on_output)
    except Withdrawn:
        call, tool_use_id = parsed.call, parsed.tool_use_id
        extra: dict[str, Any] = {"cancelled": True}
        outcome_label = Outcome.WITHDRAWN
        scope[ACCESS_EXTRA_KEY] = {"tool": call.tool, "outcome": outcome_label, "return_code": WITHDRAWN_CODE}
        return ExecResponse(
            tool_use_id=tool_use_id, execution_time_ms=0,
            result_block=ResultBlock(type=result_type_for(call.tool), tool_use_id=tool_use_id,
                                     content=CodeExecutionResult(stdout="", stderr="", return_code=WITHDRAWN_CODE,
                                                                 content=[])),
            **extra), outcome_label


async def _run_in_turn(runtime: Runtime, parsed: ExecCall, scope: Scope,
                       on_output: OutputListener | None) -> tuple[ExecResponse, str]:
    call, tool, tool_use_id, timeout = parsed.call, parsed.tool, parsed.tool_use_id, parsed.timeout
    async with runtime.calls.turn(parsed.call_id):
        started = time.monotonic()
        extra: dict[str, Any] = {}
        before = _snapshot(runtime) if tool.snapshots_files else None
        try:
            outcome = await tool.run(runtime, call.input, timeout, on_output)
        except ChildStartFailed as exc:
            raise Unavailable(str(exc), retry_after=1) from None
        if tool.restart_field is not None and (outcome.restarted or outcome.fresh):
            extra[tool.restart_field] = True
        files = [] if before is None else produced.changed(before, _snapshot(runtime),
                                                           runtime.settings.max_produced_files)
        if tool.timed:
            extra["timeout_seconds"] = int(timeout) if float(timeout).is_integer() else timeout
        elapsed_ms = int((time.monotonic() - started) * 1000)
    if outcome.limit is not None:
        extra["limit_exceeded"] = outcome.limit
    if outcome.cancelled:
        extra["cancelled"] = True
    if outcome.timed_out:
        outcome_label = "timeout"
    elif outcome.cancelled:
        outcome_label = "cancelled"
    elif outcome.limit is not None:
        outcome_label = "limit"
    else:
        outcome_label = "ok" if outcome.return_code == 0 else "failed"
    scope[ACCESS_EXTRA_KEY] = {"tool": call.tool, "outcome": outcome_label, "return_code": outcome.return_code}
    response = ExecResponse(
        tool_use_id=tool_use_id,
        execution_time_ms=elapsed_ms,
        result_block=ResultBlock(
            type=result_type_for(call.tool),
            tool_use_id=tool_use_id,
            content=CodeExecutionResult(stdout=outcome.stdout, stderr=outcome.stderr, return_code=outcome.return_code,
                                        content=[CodeExecutionOutputFile(file_id=f["file_id"], filename=f["filename"])
                                                 for f in files]),
        ),
        **extra,  # sandpool's own fields, after the contract's (their order is the wire's)
    )
    return response, outcome_label


async def cancel_call(runtime: Runtime, call_id: str | None = None) -> Response:
    """Cancel the call `call_id`, or the one running now (never queued behind it: no lock): 200 with the
    id of the call stopped or withdrawn."""
    cancelled = await runtime.cancel(call_id)
    if cancelled is None:
        raise NoRunningCall("no code or bash call is running in this session" if call_id is None else
                            "that call is neither running nor waiting in this session")
    return JSONResponse({"call_id": cancelled})


class AgentApp:
    """The agent's ASGI app below the request-id, secret and body-cap layers.

    It runs the lifespan itself (start the runtime, self-test, serve; close), answers
    `POST /sessions/{id}/exec` and `GET /healthz` straight from ASGI (the exec path is every
    call's cost: FastAPI's error, exception, exit-stack and routing layers and its
    dependency solving add ~0.3 ms of CPU to each for nothing, the handler takes the raw
    body), and hands every other request to the shared FastAPI app. Both paths run the
    same handler and render with the same response classes: tests/agent/test_wire.py pins
    the bytes.

    Every request naming a session passes the fence first (`agent.fence`, armed once the
    start-up self-test has run): the first session named is the one served; another is
    refused (409, `FENCED_HEADER`), every child is killed at once, and `on_fenced` (the
    server's exit, set by `agent.server`) ends the agent once the refusal is sent. From then
    on every session call gets the same refusal and `/healthz` fails.
    """

    def __init__(self, settings: AgentSettings, secret: str, root: str) -> None:
        self.settings = settings
        self.secret = secret
        self.root = root
        self.routes = routes_app()
        self.runtime: Runtime | None = None
        self.outer: ASGIApp = self  # the whole stack, for the self-test (set by create_app)
        self.fence: Fence | None = None  # armed after the self-test
        self.on_fenced: Callable[[], None] | None = None
        self.ending = False  # the fence refused a call: the agent is on its way out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        scope[RUNTIME_KEY] = self.runtime
        if kind == "http":
            method, path = scope["method"], scope["path"]
            fence = self.fence
            if fence is not None:
                session = session_of(path)
                if session is not None and not fence.admits(session):
                    await self._refuse(scope, receive, send)
                    return
                if fence.tripped and method == "GET" and path == "/healthz":
                    await _ENDING(scope, receive, send)
                    return
            if method == "POST" and _is_exec_path(path):
                await self._exec(scope, receive, send)
                return
            if method == "DELETE" and _is_exec_path(path):
                await self._cancel(scope, receive, send)
                return
            if method == "GET" and path == "/healthz":
                await _HEALTHY(scope, receive, send)
                return
        await self.routes(scope, receive, send)

    async def _exec(self, scope: Scope, receive: Receive, send: Send) -> None:
        runtime = self.runtime
        try:
            raw = await _read_body(receive)
            if raw is None:
                return  # the caller left before its request was whole: nobody to answer
            if runtime is None:
                raise Unavailable("the agent is not started", retry_after=1)
            if streaming.wants_stream(scope["headers"]):
                parsed = parse_exec(runtime, raw, scope)
                if isinstance(parsed, ExecCall) and parsed.streamable:
                    await self._stream(runtime, parsed, scope, receive, send)
                    return
                response = parsed if isinstance(parsed, Response) else await answer(runtime, parsed, scope)
            else:
                response = await exec_call(runtime, raw, scope)
        except SandpoolError as exc:
            response = error_response(exc)
        except Exception:
            # As FastAPI's outermost layer does: a plain 500, and the error goes on to the server's log.
            await _SERVER_ERROR(scope, receive, send)
            raise
        await response(scope, receive, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A call for a session other than the one served: kill every child now (the served
        session's state goes with them), answer the refusal, then end the agent."""
        first, self.ending = not self.ending, True
        if first and self.runtime is not None:
            self.runtime.stop_now()
        await _FENCED(scope, receive, send)
        if first and self.on_fenced is not None:
            self.on_fenced()

    async def _stream(self, runtime: Runtime, parsed: ExecCall, scope: Scope, receive: Receive, send: Send) -> None:
        """A streamed Execute (`agent.streaming`). A reader that leaves stops nothing, unless it asked
        for that with `Sandpool-Cancel-On-Disconnect: true`: then the call is cancelled."""
        cancel_on_gone = streaming.header_true(scope["headers"], streaming.CANCEL_ON_DISCONNECT)
        await send({"type": "http.response.start", "status": 200, "headers": streaming.HEADERS})
        events = streaming.OutputEvents(send, self.settings.stream_heartbeat_seconds)
        work = asyncio.ensure_future(run_call(runtime, parsed, scope, events.on_output))
        gone = asyncio.ensure_future(streaming.disconnected(receive))
        cancelling: set[asyncio.Task[str | None]] = set()

        def on_gone() -> None:
            if cancel_on_gone and not work.done():
                task = asyncio.ensure_future(runtime.cancel(parsed.call_id))
                cancelling.add(task)
                task.add_done_callback(cancelling.discard)

        try:
            try:
                await events.pump(work, gone, on_gone)
            except BaseException:
                work.cancel()
                raise
            try:
                response, outcome = work.result()
            except SandpoolError as exc:
                await events.fail(exc)
            except Exception as exc:
                log.error("streamed call failed", exc_info=exc)
                await events.fail(SandpoolError("internal error"))
            else:
                content = response.result_block.content
                await events.finish(content.stdout or "", content.stderr or "", exec_body(response), outcome)
        finally:
            gone.cancel()
            if cancelling:
                await asyncio.gather(*cancelling, return_exceptions=True)

    async def _cancel(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            if self.runtime is None:
                raise Unavailable("the agent is not started", retry_after=1)
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            response = await cancel_call(self.runtime, (query.get("call_id") or [None])[0])
        except SandpoolError as exc:
            response = error_response(exc)
        await response(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        runtime = Runtime(self.settings, self.root)
        try:
            self.runtime = runtime
            await runtime.start()
            await _self_call(self.outer, self.secret)
            self.fence = Fence()
        except BaseException:
            await runtime.close()
            await send({"type": "lifespan.startup.failed", "message": traceback.format_exc()})
            raise
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        try:
            await runtime.close()
        except BaseException:
            await send({"type": "lifespan.shutdown.failed", "message": traceback.format_exc()})
            raise
        await send({"type": "lifespan.shutdown.complete"})


class Agent:
    """The ASGI app uvicorn serves: request ids and access lines, the secret, the body caps, then
    `AgentApp`. `runtime` is the running one (None before the lifespan starts it)."""

    def __init__(self, settings: AgentSettings, secret: str, root: str) -> None:
        self.core = AgentApp(settings, secret, root)
        self.stack = RequestIdMiddleware(BearerSecretMiddleware(
            BodyLimitMiddleware(self.core, max_request_bytes=settings.max_request_bytes,
                                max_upload_bytes=settings.max_upload_bytes), secret=secret))
        self.core.outer = self.stack

    @property
    def runtime(self) -> Runtime | None:
        return self.core.runtime

    def openapi(self) -> dict[str, Any]:
        """The operations the agent serves, as FastAPI documents its routes (never served over HTTP)."""
        return self.core.routes.openapi()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stack(scope, receive, send)


def create_app(settings: AgentSettings, secret: str, *, workspace: str | None = None) -> Agent:
    return Agent(settings, secret, workspace or str(settings.workspace_dir()))


def _is_exec_path(path: str) -> bool:
    """`/sessions/{session_id}/exec` as the router matches it: one non-empty segment for the id."""
    if not (path.startswith("/sessions/") and path.endswith("/exec")):
        return False
    session_id = path[10:-5]
    return bool(session_id) and "/" not in session_id


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body (the body-cap layer below counts it), or None if the caller left."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)
        elif message["type"] == "http.disconnect":
            return None


async def _HEALTHY(scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse({"status": "ok"})(scope, receive, send)


async def _ENDING(scope: Scope, receive: Receive, send: Send) -> None:
    await JSONResponse({"status": "ending"}, status_code=503)(scope, receive, send)


async def _FENCED(scope: Scope, receive: Receive, send: Send) -> None:
    body = {"detail": "this sandbox serves another session and is ending", "reason": Reason.CONFLICT}
    await JSONResponse(body, status_code=FENCED_STATUS, headers={FENCED_HEADER: "true"})(scope, receive, send)


async def _SERVER_ERROR(scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse("Internal Server Error", status_code=500)(scope, receive, send)


async def _self_call(app: ASGIApp, secret: str) -> None:
    """One exec through the whole ASGI stack before serving: a self-test, and the first real call is warm."""
    body = json.dumps({"tool": CODE_EXECUTION, "input": {"code": "print(end='')"}}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/sessions/warm-up/exec", "raw_path": b"/sessions/warm-up/exec", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
             "headers": [(b"authorization", f"Bearer {secret}".encode()), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await app(scope, receive, send)
    if status != [200]:
        raise RuntimeError(f"agent self-test failed with {status}")


def _snapshot(runtime: Runtime) -> produced.Snapshot:
    if runtime.settings.max_produced_files == 0:
        return {}
    # Inline, not on a thread: bounded by produced_scan_limit, and for the usual small workspace the
    # thread hop costs more than the walk. Calls are serialised anyway.
    return produced.snapshot(runtime.workspace.root, runtime.settings.produced_scan_limit)


def _chunks(fileobj: Any) -> Iterator[bytes]:
    while True:
        chunk = fileobj.read(_READ_CHUNK)
        if not chunk:
            return
        yield chunk


def _stream_fd(fd: int, size: int) -> Iterator[bytes]:
    """The file's bytes from the already-checked descriptor (a later path swap cannot redirect it)."""
    try:
        remaining = size
        while remaining > 0:
            chunk = os.read(fd, min(_READ_CHUNK, remaining))
            if not chunk:
                break
            remaining -= len(chunk)
            yield chunk
    finally:
        os.close(fd)


def _list_dir(runtime: Runtime, path: str) -> FileListing:
    workspace = runtime.workspace
    fd, real = workspace.open_dir(path)
    files: list[FileEntry] = []
    truncated = False
    try:
        with os.scandir(fd) as entries:
            for entry in entries:
                if len(files) >= _LIST_LIMIT:
                    truncated = True
                    break
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                rel = os.path.normpath(os.path.join(workspace.relative(real), entry.name))
                regular = stat.S_ISREG(st.st_mode)
                files.append(FileEntry(
                    path=rel, size_bytes=st.st_size if regular else 0,
                    mime_type=mimetypes.guess_type(entry.name)[0] if regular else None,
                    modified_at=st.st_mtime, type=_entry_type(st.st_mode)))
    except OSError:
        raise NotFound(f"no such directory: {shown(path)!r}") from None
    finally:
        os.close(fd)
    files.sort(key=lambda f: f.path)
    return FileListing(files=files, truncated=truncated)


def _entry_type(mode: int) -> Literal["file", "directory", "symlink", "other"]:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


__all__ = ["OUTCOME_HEADER", "Agent", "create_app", "routes_app"]
