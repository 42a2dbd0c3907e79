"""Small ASGI pieces the services share: the contract fast path and the client-gone watch."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from sandpool.contract.operations import operation_of
from sandpool.core.errors import SandpoolError, error_response, validation_response

OperationHandler = Callable[[Request, str], Awaitable[Response]]
"""Serves one contract operation: `(request, operation name)` to the answer."""
ErrorMapper = Callable[[Exception], Response | None]
"""Answers an exception a handler raised that is not a `SandpoolError` (None: not mine, re-raise)."""


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
                raise
            response = mapped
        await response(scope, receive, send)


def session_id_of(request: Request) -> str:
    """The `{session_id}` segment of a contract path (`/sessions/{id}[/...]`)."""
    return request.scope["path"].split("/", 3)[2]


async def client_gone(request: Request) -> None:
    """Return once the client has disconnected. Only for a request whose body was read already:
    from then on the server's `receive` answers nothing but the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
