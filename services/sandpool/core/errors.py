"""The small set of named errors every service raises, and the one place they become HTTP.

A handler raises one of these; `install_error_handlers` renders it with the one
body shape (`{"detail": ..., "reason": ...}`) and the right status. A failed
*program* is never an error: it is a result (return code, stderr).
"""

from __future__ import annotations

from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sandpool.contract.reasons import Reason


class SandpoolError(Exception):
    """Base of every error that reaches a client. Subclasses fix the status."""

    status_code: ClassVar[int] = 500
    reason: ClassVar[Reason] = Reason.INTERNAL_ERROR
    """The body's stable `reason`: a member of the catalogue (`contract/reasons.py`), never a bare string."""

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"detail": self.detail, "reason": self.reason, **self.extra}


class BadRequest(SandpoolError):
    status_code = 400
    reason = Reason.BAD_REQUEST


class UnknownToolKind(BadRequest):
    reason = Reason.UNKNOWN_TOOL_KIND


class IsADirectory(BadRequest):
    reason = Reason.IS_A_DIRECTORY


class Unauthorized(SandpoolError):
    status_code = 401
    reason = Reason.UNAUTHORIZED

    def __init__(self, detail: str, **extra: Any) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": "Bearer"}, **extra)


class Forbidden(SandpoolError):
    status_code = 403
    reason = Reason.FORBIDDEN


class PathOutsideWorkspace(Forbidden):
    reason = Reason.PATH_OUTSIDE_WORKSPACE


class NotFound(SandpoolError):
    status_code = 404
    reason = Reason.NOT_FOUND


class Conflict(SandpoolError):
    status_code = 409
    reason = Reason.CONFLICT


class NoRunningCall(Conflict):
    """A cancel found no code or bash call running in the session."""

    reason = Reason.NO_RUNNING_CALL


class PayloadTooLarge(SandpoolError):
    status_code = 413
    reason = Reason.PAYLOAD_TOO_LARGE


class Invalid(SandpoolError):
    status_code = 422
    reason = Reason.INVALID_REQUEST


class _RetryAfter(SandpoolError):
    def __init__(self, detail: str, *, retry_after: int = 1, **extra: Any) -> None:
        super().__init__(detail, headers={"Retry-After": str(max(1, int(retry_after)))}, **extra)


class QuotaExceeded(_RetryAfter):
    """The workspace's own quota, rate or budget: 429, retryable later."""

    status_code = 429
    reason = Reason.QUOTA_EXCEEDED


class AtCapacity(_RetryAfter):
    """No sandbox can be leased right now: 503, retryable."""

    status_code = 503
    reason = Reason.AT_CAPACITY


class Unavailable(_RetryAfter):
    """A dependency (Redis, a sandbox's agent) cannot serve the call."""

    status_code = 503
    reason = Reason.UNAVAILABLE


class StateStoreUnavailable(Unavailable):
    """Redis cannot be reached: 503 with Retry-After; the service carries on when it is back."""

    reason = Reason.REDIS_UNAVAILABLE


class BadGateway(SandpoolError):
    """The sandbox's agent died or answered garbage mid-call."""

    status_code = 502
    reason = Reason.SANDBOX_FAILED


def error_response(exc: SandpoolError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


def validation_response(exc: RequestValidationError) -> JSONResponse:
    return JSONResponse({"detail": _validation_detail(exc), "reason": Reason.INVALID_REQUEST}, status_code=422)


def _validation_detail(exc: RequestValidationError) -> list[dict[str, Any]]:
    # Never echo the offending input back: it may be large or carry secrets.
    return [{"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()]


def install_error_handlers(app: FastAPI) -> None:
    """Map named errors, validation failures and stray HTTP errors to one body shape."""

    @app.exception_handler(SandpoolError)
    async def _named(_: Request, exc: SandpoolError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        reason = {404: Reason.NOT_FOUND, 405: Reason.METHOD_NOT_ALLOWED}.get(exc.status_code, Reason.HTTP_ERROR)
        return JSONResponse({"detail": exc.detail, "reason": reason}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))
