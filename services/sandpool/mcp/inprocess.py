"""The backend of `/mcp`: contract operations served in process, no HTTP to the api's own contract.

Each operation is a request scope (method, path, the caller's own `Authorization`, the
body) handed to the api's contract entry (`sandpool.api.contract.Contract.asgi`, inside
the edge's request ids and metrics), and its response read as it is sent. So a tool
call is authenticated, admitted and metered exactly as the same contract call over
HTTP. Execute is asked for its event stream with cancel-on-disconnect: output reaches
the MCP client as it comes, and an MCP call that is cancelled (its task cancelled)
"disconnects", which stops the call in the sandbox as `DELETE /sessions/{id}/exec` does.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote, urlencode

from starlette.types import ASGIApp, Message

from sandpool.contract.agent_protocol import CANCEL_ON_DISCONNECT_HEADER, EVENT_STREAM, Event
from sandpool.mcp.backend import CallRefused, OnOutput, refusal

_pending: set[asyncio.Future[Any]] = set()
"""Responses whose caller was cancelled: they finish on their own (their call's `done` included)."""


class Answer:
    """A contract answer read in process: status, headers, body (or, streamed, the events already handed on)."""

    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = bytearray()

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def refusal(self) -> CallRefused:
        return refusal(self.status, self.json(), self.headers.get("retry-after"))


class InProcessBackend:
    """The contract's operations for one MCP request's caller, served by `app` (an ASGI contract entry)."""

    def __init__(self, app: ASGIApp, owner: Any, *, authorization: str | None, request_id: str | None = None,
                 client: tuple[str, int] | None = None) -> None:
        self.app = app
        self.owner = owner
        """The api app (handlers read `request.app.state`)."""
        self.authorization = authorization
        self.request_id = request_id
        self.client = client

    async def _call(self, method: str, path: str, *, query: dict[str, str] | None = None, body: bytes = b"",
                    content_type: str | None = None, stream: bool = False,
                    on_body: Callable[[bytes], Awaitable[None]] | None = None) -> Answer:
        headers: list[tuple[bytes, bytes]] = [(b"host", b"sandpool.mcp")]
        if self.authorization:
            headers.append((b"authorization", self.authorization.encode("latin-1")))
        if self.request_id:
            headers.append((b"x-request-id", self.request_id.encode("latin-1")))
        if content_type:
            headers.append((b"content-type", content_type.encode("latin-1")))
        if body or method == "POST":
            headers.append((b"content-length", str(len(body)).encode()))
        if stream:
            headers += [(b"accept", EVENT_STREAM.encode()), (CANCEL_ON_DISCONNECT_HEADER.lower().encode(), b"true")]
        raw_path = quote(path, safe="/")
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": raw_path.encode(), "root_path": "",
            "query_string": urlencode(query or {}).encode(), "headers": headers, "client": self.client,
            "server": ("sandpool.mcp", 0), "app": self.owner, "state": {},
        }
        answer = Answer()
        delivered = False
        gone = asyncio.Event()

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer.status = message["status"]
                answer.headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                                  for k, v in message.get("headers", ())}
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if on_body is not None and answer.status == 200 and _is_stream(answer.headers):
                    await on_body(chunk)
                else:
                    answer.body += chunk

        served = asyncio.ensure_future(self.app(scope, receive, send))
        try:
            await asyncio.shield(served)
        except asyncio.CancelledError:
            gone.set()  # the MCP call was cancelled: the client of this in-process request "left"
            _pending.add(served)
            served.add_done_callback(_pending.discard)
            raise
        return answer

    async def create_session(self) -> str:
        answer = await self._call("POST", "/sessions", body=b"{}", content_type="application/json")
        if answer.status != 201:
            raise answer.refusal()
        handle = answer.json()
        return str(handle["session_id"])

    async def execute(self, session_id: str, body: dict[str, Any], on_output: OnOutput | None) -> dict[str, Any]:
        events = EventReader(on_output)
        answer = await self._call("POST", f"/sessions/{session_id}/exec", body=json.dumps(body).encode(),
                                  content_type="application/json", stream=True, on_body=events.feed)
        if answer.status != 200:
            raise answer.refusal()
        if not _is_stream(answer.headers):  # (a plain answer: the whole result at once)
            result = answer.json()
            if not isinstance(result, dict):
                raise CallRefused(502, "the Execute answer is not a result")
            return result
        return events.result()

    async def cancel(self, session_id: str) -> None:
        answer = await self._call("DELETE", f"/sessions/{session_id}/exec")
        if answer.status not in (200, 204, 409):
            raise answer.refusal()

    async def put_file(self, session_id: str, path: str, data: bytes) -> dict[str, Any]:
        boundary = secrets.token_hex(16)
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"path\"\r\n\r\n".encode()
                + path.encode("utf-8")
                + f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"upload\"\r\n"
                  "Content-Type: application/octet-stream\r\n\r\n".encode()
                + data + f"\r\n--{boundary}--\r\n".encode())
        answer = await self._call("POST", f"/sessions/{session_id}/files", body=body,
                                  content_type=f"multipart/form-data; boundary={boundary}")
        if answer.status not in (200, 201):
            raise answer.refusal()
        stored = answer.json()
        return stored if isinstance(stored, dict) else {}

    async def get_file(self, session_id: str, path: str) -> bytes:
        answer = await self._call("GET", f"/sessions/{session_id}/files", query={"path": path})
        if answer.status != 200:
            raise answer.refusal()
        return bytes(answer.body)

    async def destroy_session(self, session_id: str) -> None:
        answer = await self._call("DELETE", f"/sessions/{session_id}")
        if answer.status not in (200, 204):
            raise answer.refusal()


def _is_stream(headers: dict[str, str]) -> bool:
    return headers.get("content-type", "").startswith(EVENT_STREAM)


class EventReader:
    """The api's Execute event stream, read as it is sent: output handed on, then the result (or the error)."""

    def __init__(self, on_output: OnOutput | None) -> None:
        self.on_output = on_output
        self._buf = bytearray()
        self._result: dict[str, Any] | None = None
        self._error: CallRefused | None = None

    async def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        while (end := self._buf.find(b"\n\n")) >= 0:
            block = bytes(self._buf[:end])
            del self._buf[:end + 2]
            await self._event(block)

    async def _event(self, block: bytes) -> None:
        name, data = "", ""
        for line in block.decode("utf-8", errors="replace").split("\n"):
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data += line[len("data: "):]
        if not name or not data:
            return  # a comment (heartbeat)
        try:
            value = json.loads(data)
        except ValueError:
            return
        if not isinstance(value, dict):
            return
        if name in (Event.STDOUT, Event.STDERR):
            if self.on_output is not None and isinstance(value.get("text"), str):
                await self.on_output(name, value["text"])
        elif name == Event.RESULT:
            self._result = value
        elif name == Event.ERROR:
            raw_status = value.get("status")
            status = raw_status if isinstance(raw_status, int) else 502
            self._error = refusal(status, value)

    def result(self) -> dict[str, Any]:
        if self._result is not None:
            return self._result
        raise self._error or CallRefused(502, "the call's stream ended before its result")


__all__ = ["InProcessBackend"]
