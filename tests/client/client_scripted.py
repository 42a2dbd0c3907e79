"""A real HTTP server on loopback whose answers a test scripts, to drive the client's error and retry paths.

Each route answers from a queue the test fills (status, headers, JSON body);
an empty queue answers from the route's default. Every request is recorded
(method, path, headers, body) so a test can count attempts and check headers.
A reply's `chunks` go out as separate writes: what a client must put together across network reads.
It is a server, not a mock of httpx: the client under test does real HTTP.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from testkit import ThreadServer


@dataclass
class Reply:
    status: int
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None
    chunks: list[bytes] | None = None  # sent as separate writes (HTTP chunks), so the client reads them apart


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def ok_exec_body(stdout: str = "", **extra: Any) -> dict[str, Any]:
    return {
        "tool_use_id": "toolu_1",
        "execution_time_ms": 3,
        "result_block": {
            "type": "code_execution_tool_result",
            "tool_use_id": "toolu_1",
            "content": {"type": "code_execution_result", "stdout": stdout, "stderr": "", "return_code": 0,
                        "content": []},
        },
        **extra,
    }


DEFAULTS: dict[tuple[str, str], Reply] = {
    ("POST", "/sessions"): Reply(201, {"session_id": "s-1", "idle_timeout_seconds": 60}),
    ("DELETE", "/sessions/s-1"): Reply(204),
    ("POST", "/sessions/s-1/exec"): Reply(200, ok_exec_body("hi\n")),
    ("GET", "/sessions/s-1/files"): Reply(200, raw=b"bytes"),
    ("GET", "/sessions/s-1/files/list"): Reply(200, {"files": []}),
    ("POST", "/sessions/s-1/files"): Reply(201, {"path": "a.txt", "size_bytes": 5}),
}


class ScriptedServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.queues: dict[tuple[str, str], deque[Reply]] = {}
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        app = FastAPI()
        app.add_api_route("/{path:path}", self._handle, methods=["GET", "POST", "DELETE"])
        self._server = ThreadServer(app, port=port, log_level="warning", ws="none", lifespan="off",
                                    access_log=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._server.stop(10)

    def reset(self) -> None:
        with self._lock:
            self.queues.clear()
            self.seen.clear()

    def script(self, method: str, path: str, *replies: Reply) -> None:
        with self._lock:
            self.queues.setdefault((method, path), deque()).extend(replies)

    def hits(self, method: str, path: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.method == method and s.path == path]

    async def _handle(self, request: Request, path: str) -> Response:
        key = (request.method, "/" + path)
        body = await request.body()
        with self._lock:
            self.seen.append(Seen(request.method, key[1], dict(request.headers), body))
            queue = self.queues.get(key)
            reply = queue.popleft() if queue else DEFAULTS.get(key, Reply(404, {"detail": "no such route",
                                                                                "reason": "not_found"}))
        if reply.chunks is not None:
            return StreamingResponse(iter(reply.chunks), status_code=reply.status, headers=reply.headers)
        if reply.raw is not None:
            return Response(reply.raw, status_code=reply.status, headers=reply.headers,
                            media_type="application/octet-stream")
        if reply.status == 204:
            return Response(status_code=204, headers=reply.headers)
        return JSONResponse(reply.body, status_code=reply.status, headers=reply.headers)
