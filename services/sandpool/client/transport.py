"""Turning one HTTP exchange into a value or an error, and deciding whether to offer it again.

Shared by the sync and async clients; no I/O here.
"""

from __future__ import annotations

from typing import Any

import httpx

from sandpool.client.calls import Call, Retry, T
from sandpool.client.errors import (
    ConnectionFailed,
    ConnectionLost,
    ProtocolError,
    QuotaExceeded,
    ResponseTimeout,
    SandpoolClientError,
    Unavailable,
    error_from_response,
)
from sandpool.client.retry import RetryPolicy

REQUEST_ID_HEADER = "X-Request-Id"


def error_for_transport(call: Call[Any], exc: httpx.TransportError) -> SandpoolClientError:
    where = f"{call.method} {call.path}"
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)):
        err: SandpoolClientError = ConnectionFailed(f"could not connect for {where}: {exc}")
    elif isinstance(exc, httpx.TimeoutException):
        err = ResponseTimeout(f"no answer in time for {where}")
    else:
        err = ConnectionLost(f"connection lost during {where}: {exc}")
    err.__cause__ = exc
    return err


def read_response(call: Call[T], resp: httpx.Response) -> tuple[T | None, SandpoolClientError | None]:
    """The parsed value of a successful answer, or the error an unsuccessful one stands for."""
    if resp.status_code in call.expect:
        try:
            return call.parse(resp), None
        except ProtocolError as err:
            return None, err
    if call.absent_ok and resp.status_code == 404:
        return None, None
    try:
        body = resp.json()
    except ValueError:
        body = None
    return None, error_from_response(resp.status_code, resp.headers, body)


def may_retry(call: Call[Any], err: SandpoolClientError) -> bool:
    """Whether this call may be offered again automatically after `err` (see `calls` for the rules)."""
    if isinstance(err, ConnectionFailed):
        return call.rewind is None or call.rewind()
    if call.retry is Retry.SAFE:
        return isinstance(err, (QuotaExceeded, Unavailable, ConnectionLost))
    if call.retry is Retry.REFUSED:
        return isinstance(err, (QuotaExceeded, Unavailable))
    return False


def retry_delay(policy: RetryPolicy, call: Call[Any], err: SandpoolClientError, retry_number: int,
                waited: float) -> float | None:
    """Seconds to wait before offering `call` again, or None to raise `err` now."""
    if not may_retry(call, err):
        return None
    return policy.next_delay(retry_number, retry_after=err.retry_after, waited=waited)


def finish_error(err: SandpoolClientError, request_id: str, attempts: int) -> SandpoolClientError:
    err.request_id = request_id
    err.attempts = attempts
    return err


__all__ = ["REQUEST_ID_HEADER", "error_for_transport", "finish_error", "may_retry", "read_response",
           "retry_delay"]
