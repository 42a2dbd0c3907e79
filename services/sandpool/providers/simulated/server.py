"""One server answering the agent protocol for every simulated sandbox.

The api reaches a sandbox at the address and with the secret the controller published
(`docs/architecture.md`, "Agent command line"); here every simulated sandbox has the same
address and its own secret, and the secret says which sandbox a call is for. What a call
costs the api, the controller and Redis is the real cost; what it costs here is a dict
look-up: Execute answers a fixed result after `exec_delay` seconds, files live in memory.

Kept as the agent keeps them: `GET /healthz` is the only unauthenticated path; every other
one needs `Authorization: Bearer <the sandbox's secret>` (401 otherwise); bodies over the
caps are 413; calls to one sandbox run one at a time; an unknown tool kind is 400, a bad
body 422. Not simulated: streaming (a streamed Execute gets the one JSON answer, which
the api relays as such) and cancelling (there is never a call to stop: 409).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import mimetypes
import posixpath
import secrets
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote

from pydantic import TypeAdapter, ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from sandpool.contract.agent_protocol import OUTCOME_HEADER, Outcome
from sandpool.contract.models import (
    CodeExecutionResult,
    ExecResponse,
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
    PayloadTooLarge,
    SandpoolError,
    Unauthorized,
    UnknownToolKind,
    error_response,
)
from sandpool.providers.simulated.files import MemoryWorkspace
from sandpool.providers.simulated.settings import SimulatedProviderSettings

FIXED_STDOUT = "simulated\n"
"""What every simulated Execute prints: no code runs."""
_EXEC_RESPONSE: TypeAdapter[ExecResponse] = TypeAdapter(ExecResponse)
_MULTIPART_OVERHEAD = 64 * 1024


@dataclass
class SimulatedSandbox:
    sandbox_id: str
    secret: str
    workspace: MemoryWorkspace
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SimulatedAgents:
    """The ASGI app: routes a call to the sandbox its secret names."""

    def __init__(self, settings: SimulatedProviderSettings) -> None:
        self.settings = settings
        self.by_secret: dict[bytes, SimulatedSandbox] = {}

    def add(self, sandbox: SimulatedSandbox) -> None:
        self.by_secret[("Bearer " + sandbox.secret).encode()] = sandbox

    def remove(self, sandbox: SimulatedSandbox) -> None:
        self.by_secret.pop(("Bearer " + sandbox.secret).encode(), None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path == "/healthz" and method in ("GET", "HEAD"):
            await JSONResponse({"status": "ok"})(scope, receive, send)
            return
        try:
            response = await self._route(scope, receive, method, path)
        except SandpoolError as exc:
            response = error_response(exc)
        await response(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, method: str, path: str) -> Response:
        presented = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        sandbox = self.by_secret.get(presented)
        if sandbox is None:  # (a dict look-up, not a constant-time compare: nothing here is worth guarding)
            raise Unauthorized("missing or wrong agent secret")
        parts = path.split("/")
        if len(parts) < 4 or parts[1] != "sessions" or not parts[2]:
            raise NotFound("no such path")
        tail = "/".join(parts[3:])
        query = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1")).items()}
        s = self.settings
        if tail == "exec" and method == "POST":
            body = await _body(receive, _declared(scope), s.simulated_max_request_bytes)
            async with sandbox.lock:
                return await self._execute(body)
        if tail == "exec" and method == "DELETE":
            raise NoRunningCall("no code or bash call is running in this session")
        if tail == "files/list" and method == "GET":
            async with sandbox.lock:
                return _model(sandbox.workspace.listing(query.get("path", ".")))
        if tail == "files" and method == "GET":
            if "path" not in query:
                raise Invalid("query parameter 'path' is required")
            async with sandbox.lock:
                data = sandbox.workspace.read(query["path"], max_bytes=s.simulated_max_read_bytes)
            name = posixpath.basename(query["path"])
            return Response(data, media_type=mimetypes.guess_type(name)[0] or "application/octet-stream",
                            headers={"Content-Disposition": f"attachment; filename*=UTF-8''{quote(name, safe='')}"})
        if tail == "files" and method == "POST":
            return await self._put_file(scope, receive, sandbox)
        raise NotFound("no such path")

    async def _execute(self, raw: bytes) -> Response:
        try:
            call = parse_exec_request(json.loads(raw))
        except (ValueError, UnicodeDecodeError) as exc:
            if isinstance(exc, UnknownTool):
                raise UnknownToolKind(str(exc)) from None
            if isinstance(exc, ValidationError):
                return JSONResponse({"detail": exc.errors(include_url=False, include_context=False,
                                                          include_input=False),
                                     "reason": Reason.INVALID_REQUEST}, status_code=422)
            raise Invalid("request body is not JSON") from None
        if self.settings.simulated_exec_delay_seconds:
            await asyncio.sleep(self.settings.simulated_exec_delay_seconds)
        tool_use_id = call.tool_use_id or "srvtoolu_" + secrets.token_hex(12)
        result = ExecResponse(
            tool_use_id=tool_use_id, execution_time_ms=int(self.settings.simulated_exec_delay_seconds * 1000),
            result_block=ResultBlock(type=result_type_for(call.tool), tool_use_id=tool_use_id,
                                     content=CodeExecutionResult(stdout=FIXED_STDOUT, stderr="", return_code=0)))
        return Response(_EXEC_RESPONSE.dump_json(result), media_type="application/json",
                        headers={OUTCOME_HEADER: Outcome.OK})

    async def _put_file(self, scope: Scope, receive: Receive, sandbox: SimulatedSandbox) -> Response:
        cap = self.settings.simulated_max_upload_bytes
        if _declared(scope) > cap + _MULTIPART_OVERHEAD:
            raise PayloadTooLarge(f"request body over the {cap}-byte cap")
        form = await Request(scope, receive).form(max_files=1, max_fields=4)
        try:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise Invalid("multipart field 'file' is required")
            target = form.get("path")
            if target is not None and not isinstance(target, str):
                raise Invalid("multipart field 'path' must be text")
            target = target or posixpath.basename(upload.filename or "")
            if not target:
                raise Invalid("no 'path' given and the upload has no file name")
            data = await upload.read(cap + 1)
            if len(data) > cap:
                raise PayloadTooLarge(f"file over the {cap}-byte cap; nothing was written")
            async with sandbox.lock:
                rel = sandbox.workspace.write(target, data)
        finally:
            await form.close()
        return _model(FileUploadResult(path=rel, size_bytes=len(data)), status_code=201)


def _model(model: Any, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


def _declared(scope: Scope) -> int:
    for name, value in scope["headers"]:
        if name == b"content-length":
            with contextlib.suppress(ValueError):
                return int(value)
    return 0


async def _body(receive: Receive, declared: int, cap: int) -> bytes:
    if declared > cap:
        raise PayloadTooLarge(f"request body over the {cap}-byte cap")
    chunks: list[bytes] = []
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > cap:
            raise PayloadTooLarge(f"request body over the {cap}-byte cap")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
