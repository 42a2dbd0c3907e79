"""Small ASGI pieces the services share: the contract fast path and the client-gone watch."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sandpool.contract.operations import operation_of
from sandpool.contract.reasons import Reason
from sandpool.core.errors import SandpoolError, error_response, validation_response

log = logging.getLogger(__name__)

OperationHandler = Callable[[Request, str], Awaitable[Response]]
"""Serves one contract operation: `(request, operation name)` to the answer."""
ErrorMapper = Callable[[Exception], Response | None]
"""Answers an exception a handler raised that is not a `SandpoolError` (None: not mine, re-raise)."""


class ContractApp(FastAPI):
    """FastAPI, except that the contract's operations can go past its per-request machinery.

    `FastAPI.__call__` checks its telemetry switches (three environment lookups when
    OpenTelemetry is installed) and runs Starlette's middleware stack on every
    request; for the contract calls, the hot path, `serve_operations` installs a
    lean chain (the service's own outer middleware around an `OperationFastPath`)
    that takes them first. With tracing on, everything goes through FastAPI, whose
    instrumented middleware makes the server spans.
    """

    operations: ASGIApp | None = None

    def serve_operations(self, handler: OperationHandler, *, errors: ErrorMapper | None = None,
                         outer: Callable[[ASGIApp], ASGIApp] = lambda app: app) -> None:
        self.operations = outer(OperationFastPath(super().__call__, handler, errors))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.operations is not None and scope["type"] == "http"
                and operation_of(scope["method"], scope["path"]) is not None):
            scope["app"] = self  # what FastAPI would set: handlers read `request.app.state`
            await self.operations(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


class OperationFastPath:
    """Serves the contract's operations straight from ASGI, ahead of FastAPI's router.

    The contract calls are the hot path, and FastAPI's routing, dependency solving
    and exception middlewares cost a good part of a call's budget for nothing (the
    handlers take the raw request). Every other path (probes, metrics, the admin API)
    goes on to the app. Named errors become their JSON answer here, as FastAPI's
    handlers would make them; a client that left mid-upload gets nothing.
    """

    def __init__(self, app: ASGIApp, handler: OperationHandler, errors: ErrorMapper | None = None) -> None:
        self.app = app
        self.handler = handler
        self.errors = errors

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        operation = operation_of(scope["method"], scope["path"]) if scope["type"] == "http" else None
        if operation is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            response = await self.handler(request, operation)
        except SandpoolError as exc:
            response = error_response(exc)
        except RequestValidationError as exc:
            response = validation_response(exc)
        except ClientDisconnect:
            return  # nobody to answer
        except Exception as exc:
            mapped = self.errors(exc) if self.errors is not None else None
            if mapped is None:
                log.exception("unhandled error", extra={"operation": operation})
                mapped = JSONResponse({"detail": "internal error", "reason": Reason.INTERNAL_ERROR}, status_code=500)
            response = mapped
        await response(scope, receive, send)


def session_id_of(request: Request) -> str:
    """The `{session_id}` segment of a contract path (`/sessions/{id}[/...]`)."""
    path: str = request.scope["path"]
    return path.split("/", 3)[2]


async def client_gone(request: Request) -> None:
    """Return once the client has disconnected. Only for a request whose body was read already:
    from then on the server's `receive` answers nothing but the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
