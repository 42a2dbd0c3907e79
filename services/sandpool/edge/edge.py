"""The outermost layer of the api: request ids and per-request metrics, as plain ASGI (no per-request
task or body buffering that `BaseHTTPMiddleware` would add).

A client's `X-Request-Id` is kept when it is short and printable, otherwise one
is generated; it is set in `core.logs.request_id_var` for every log line, passed
to the session's agent and returned on the response. Route handlers name their
operation in `scope["sandpool.operation"]` so the metrics carry a closed set of
labels (unmatched paths count as `other`).
"""

from __future__ import annotations

import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandpool.core.logs import request_id_var
from sandpool.core.request_ids import ACCESS_EXTRA_KEY, log_access, request_id_from, with_request_id
from sandpool.sessions.metrics import ApiMetrics

OPERATION_KEY = "sandpool.operation"
REQUEST_ID_KEY = "sandpool.request_id"


class EdgeMiddleware:
    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_from(scope)
        scope[REQUEST_ID_KEY] = request_id
        token = request_id_var.set(request_id)
        status: dict[str, Any] = {"code": 500, "observed": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                with_request_id(message, request_id)
                status["code"] = message["status"]
                self._observe(scope, status, started)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self._observe(scope, status, started)
            request_id_var.reset(token)

    def _observe(self, scope: Scope, status: dict[str, Any], started: float) -> None:
        if status["observed"]:
            return
        status["observed"] = True
        operation, seconds = scope.get(OPERATION_KEY, "other"), time.perf_counter() - started
        self.metrics.observe(operation, status["code"], seconds)
        log_access(scope, status["code"], started, operation=operation, **scope.get(ACCESS_EXTRA_KEY, {}))
