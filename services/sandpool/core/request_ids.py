"""Request ids: the one a caller sent in `X-Request-Id` when it is short and printable,
else a fresh one. Each service sets it in `core.logs.request_id_var` (so every log line
of the request carries it), passes it on to the next hop and returns it on the response.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from sandpool.core.logs import request_id_var

HEADER = "X-Request-Id"
_HEADER_KEY = HEADER.lower().encode()
_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")

access_log = logging.getLogger("sandpool.access")
ACCESS_EXTRA_KEY = "sandpool.access"  # a route may add fields (closed-set values) to its access line here
_QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # probes and scrapes: no access line


def request_id_from(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == _HEADER_KEY:
            candidate: str = value.decode("latin-1")
            if _PATTERN.fullmatch(candidate):
                return candidate
            break
    return uuid.uuid4().hex


def with_request_id(message: Message, request_id: str) -> Message:
    """An `http.response.start` message carrying exactly one `X-Request-Id`: ours."""
    headers = [h for h in message.get("headers", []) if h[0].lower() != _HEADER_KEY]
    headers.append((_HEADER_KEY, request_id.encode("latin-1")))
    message["headers"] = headers
    return message


RequestDone = Callable[[Scope, int, float], None]
"""Called with (scope, status, seconds) once a request is answered: a service's request metrics."""


class RequestIdMiddleware:
    """Pure ASGI: request id in and out, one access line per request (at info), then `on_done`.

    The agent uses it as it is; the api's edge does the same next to its metrics, observed at
    the first byte of the answer.
    """

    def __init__(self, app: Any, *, on_done: RequestDone | None = None) -> None:
        self.app = app
        self.on_done = on_done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope)
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                with_request_id(message, request_id)
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log_access(scope, status, started, **scope.get(ACCESS_EXTRA_KEY, {}))
            request_id_var.reset(token)
            if self.on_done is not None:
                self.on_done(scope, status, time.perf_counter() - started)


def log_access(scope: Scope, status: int, started: float, **extra: Any) -> None:
    """One line per request served, with the request id (from the context) like every other line."""
    if scope["path"] not in _QUIET_PATHS and access_log.isEnabledFor(logging.INFO):
        access_log.info("request", extra={"method": scope["method"], "path": scope["path"], "status": status,
                                          "ms": round((time.perf_counter() - started) * 1000, 3), **extra})
