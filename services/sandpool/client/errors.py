"""The client's exceptions: one base, one class per condition a caller handles differently.

Every error carries the HTTP `status` (None when no response arrived), the
server's stable `reason` string when it sent one, and `retryable`: whether the
same call may succeed if offered again later. Capacity (503), quota or rate
(429), a failed sandbox (502) and a connection that never reached the server are
retryable; every other 4xx is a mistake in the request and is not.

`error_from_response` is the one place statuses become exceptions, so the sync
and async clients cannot disagree about it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sandpool.client.retry import parse_retry_after
from sandpool.contract.reasons import ClientReason, Reason, status_of


class SandpoolClientError(Exception):
    """Base of every error the client raises."""

    retryable: bool = False
    default_reason: Reason | ClientReason | None = None
    """The `reason` when the server sent none (a catalogued reason, or one the client sets itself)."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        reason: str | None = None,
        detail: Any = None,
        retry_after: float | None = None,
        body: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason if reason is not None else self.default_reason
        self.detail = detail
        self.retry_after = retry_after
        """Seconds the server asked us to wait (`Retry-After`), when it said."""
        self.body: dict[str, Any] = dict(body or {})
        """The whole error body, including any extension fields the server added."""
        self.request_id: str | None = None
        """The `X-Request-Id` the client sent (the same on every retry), for finding the call in server logs."""
        self.attempts = 1
        """How many times the call was offered before this error was raised."""

    def __str__(self) -> str:
        parts = [self.message]
        if self.status is not None:
            parts.append(f"status={self.status}")
        if self.reason:
            parts.append(f"reason={self.reason}")
        return " ".join(parts)


# --- no response ---------------------------------------------------------------------------


class ConnectionFailed(SandpoolClientError):
    """The request never reached the server (refused, DNS, TLS, connect timeout): safe to retry."""

    retryable = True
    default_reason = ClientReason.CONNECTION_FAILED


class ConnectionLost(SandpoolClientError):
    """The connection broke after the request may have been sent: the call may or may not have run.

    Retryable, but retried automatically only for calls that are safe to repeat.
    """

    retryable = True
    default_reason = ClientReason.CONNECTION_LOST


class ResponseTimeout(SandpoolClientError):
    """The request was sent but no answer came in time.

    Not retryable: the server may have run the call (an Execute may still be
    running), so offering it again could run it twice.
    """

    default_reason = ClientReason.RESPONSE_TIMEOUT


class ProtocolError(SandpoolClientError):
    """The server answered with a body that is not what contract version 1 promises."""

    default_reason = ClientReason.PROTOCOL_ERROR


# --- 4xx: the request is wrong, not retryable -------------------------------------------------


class BadRequest(SandpoolClientError):
    """400 (an unknown tool kind, a directory where a file was expected) or, via `InvalidRequest`, 422."""

    default_reason = Reason.BAD_REQUEST


class InvalidRequest(BadRequest):
    """422: a malformed body or a tool input missing its fields."""

    default_reason = Reason.INVALID_REQUEST


class Unauthorized(SandpoolClientError):
    """401: the bearer token is missing, expired, revoked or not trusted."""

    default_reason = Reason.UNAUTHORIZED


class Forbidden(SandpoolClientError):
    """403: not allowed (an image outside the workspace's allow-list, an admin-only call)."""

    default_reason = Reason.FORBIDDEN


class ImageNotAllowed(Forbidden):
    """403: the workspace's policy does not allow the requested `image` (nothing was leased)."""

    default_reason = Reason.IMAGE_NOT_ALLOWED


class PathOutsideWorkspace(Forbidden):
    """403: a file path that escapes the session's workspace."""

    default_reason = Reason.PATH_OUTSIDE_WORKSPACE


class NotFound(SandpoolClientError):
    """404: the session is gone (destroyed, reaped, never existed), or the file does not exist."""

    default_reason = Reason.NOT_FOUND


class PayloadTooLarge(SandpoolClientError):
    """413: the upload or request body is over the server's cap; nothing was written."""

    default_reason = Reason.PAYLOAD_TOO_LARGE


# --- retryable statuses --------------------------------------------------------------------


class QuotaExceeded(SandpoolClientError):
    """429: the workspace's own quota, rate or budget is exhausted; `retry_after` says when to retry."""

    retryable = True
    default_reason = Reason.QUOTA_EXCEEDED

    @property
    def limit(self) -> str | None:
        """sandpool: which limit refused (`concurrent_sessions`, `daily_session_seconds`, `requests_per_minute`)."""
        value = self.body.get("limit")
        return value if isinstance(value, str) else None


class Unavailable(SandpoolClientError):
    """503: the call could not be served now (a dependency is down, or the session's sandbox is unreachable).

    `reason` says which: `redis_unavailable`, `sandbox_unavailable` (the session is gone; create a
    new one), ... (`scheduler_unavailable`, from servers before the api, is retired)
    """

    retryable = True
    default_reason = Reason.UNAVAILABLE


class AtCapacity(Unavailable):
    """503: no sandbox could be leased; nothing was leased. Retry after `retry_after`."""

    default_reason = Reason.AT_CAPACITY


class SandboxFailed(SandpoolClientError):
    """502: the session's sandbox died or answered garbage; the session is gone, a new one will work."""

    retryable = True
    default_reason = Reason.SANDBOX_FAILED


class ServerError(SandpoolClientError):
    """Any other 5xx."""

    default_reason = ClientReason.SERVER_ERROR


def _reason_of(cls: type[SandpoolClientError]) -> Reason:
    return Reason(str(cls.default_reason))  # a ValueError at import for a class naming no wire reason


def _status_of(cls: type[SandpoolClientError]) -> int:
    """The status of the class's reason, from the catalogue of reasons."""
    status = status_of(_reason_of(cls))
    assert status is not None, f"{cls.__name__}'s reason has no fixed status"
    return status


_BY_STATUS: dict[int, type[SandpoolClientError]] = {
    _status_of(cls): cls
    for cls in (BadRequest, Unauthorized, Forbidden, NotFound, PayloadTooLarge, InvalidRequest, QuotaExceeded,
                SandboxFailed, AtCapacity)
}
"""The class of each status (a 503 without a reason is `AtCapacity`, below)."""

_BY_REASON: dict[tuple[int, str], type[SandpoolClientError]] = {
    (_status_of(cls), _reason_of(cls)): cls for cls in (PathOutsideWorkspace, ImageNotAllowed, AtCapacity)
}
"""The classes a reason picks out of its status's class."""


def error_class_for(status: int, reason: str | None) -> type[SandpoolClientError]:
    """The exception class for an error status (and, where it refines it, the body's `reason`).

    A 503 without a reason is `AtCapacity`: that is what the contract uses 503 for,
    and a gateway other than sandpool sends no `reason`. A 503 whose reason is
    anything but `at_capacity` is `Unavailable` (a dependency, not capacity).
    """
    if reason is not None and (status, reason) in _BY_REASON:
        return _BY_REASON[(status, reason)]
    if status == 503 and reason is not None:
        return Unavailable
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    if 400 <= status < 500:
        return BadRequest
    return ServerError


def _message_from(detail: Any, status: int) -> str:
    if isinstance(detail, str) and detail:
        return detail
    if isinstance(detail, list) and detail:
        # FastAPI-style validation errors: [{"loc": [...], "msg": "..."}]
        msgs = []
        for item in detail[:3]:
            if isinstance(item, Mapping):
                loc = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
                msgs.append(f"{loc}: {item.get('msg', '')}" if loc else str(item.get("msg", "")))
        if msgs:
            return "; ".join(msgs)
    return f"HTTP {status}"


def error_from_response(status: int, headers: Mapping[str, str], body: Any) -> SandpoolClientError:
    """Build the exception for an error response.

    `headers` is any case-insensitive mapping (httpx's `Headers`) or a plain dict
    with lower-case keys; `body` is the decoded JSON (or None when it was not JSON).
    The body is informational: a status alone is enough to pick the class.
    """
    fields: dict[str, Any] = dict(body) if isinstance(body, Mapping) else {}
    reason = fields.get("reason")
    if not isinstance(reason, str) or not reason:
        reason = None
    detail = fields.get("detail")
    retry_after_raw = headers.get("retry-after") or headers.get("Retry-After")
    cls = error_class_for(status, reason)
    return cls(
        _message_from(detail, status),
        status=status,
        reason=reason,
        detail=detail,
        retry_after=parse_retry_after(retry_after_raw),
        body=fields,
    )


__all__ = [
    "AtCapacity",
    "BadRequest",
    "ConnectionFailed",
    "ConnectionLost",
    "Forbidden",
    "ImageNotAllowed",
    "InvalidRequest",
    "NotFound",
    "PathOutsideWorkspace",
    "PayloadTooLarge",
    "ProtocolError",
    "QuotaExceeded",
    "ResponseTimeout",
    "SandboxFailed",
    "SandpoolClientError",
    "ServerError",
    "Unauthorized",
    "Unavailable",
    "error_class_for",
    "error_from_response",
]
