"""The Python client of contract v1: sync (`Client`) and asyncio (`AsyncClient`).

It speaks only the contract (plus sandpool's extension fields, read when
present), so it works against sandpool's api (with auth or `--no-auth`), or any
other backend or gateway that serves contract v1 with an optional bearer token.
Guide: docs/client.md.
"""

from sandpool.client.aio import AsyncClient, AsyncSession
from sandpool.client.errors import (
    AtCapacity,
    BadRequest,
    ConnectionFailed,
    ConnectionLost,
    Forbidden,
    ImageNotAllowed,
    InvalidRequest,
    NotFound,
    PathOutsideWorkspace,
    PayloadTooLarge,
    ProtocolError,
    QuotaExceeded,
    ResponseTimeout,
    SandboxFailed,
    SandpoolClientError,
    ServerError,
    Unauthorized,
    Unavailable,
)
from sandpool.client.events import ExecEvent
from sandpool.client.results import ExecResult, FileInfo, OutputFile, SessionInfo, UploadResult
from sandpool.client.retry import RetryPolicy
from sandpool.client.sync import Client, Session

__all__ = [
    "AsyncClient",
    "AsyncSession",
    "AtCapacity",
    "BadRequest",
    "Client",
    "ConnectionFailed",
    "ConnectionLost",
    "ExecEvent",
    "ExecResult",
    "FileInfo",
    "Forbidden",
    "ImageNotAllowed",
    "InvalidRequest",
    "NotFound",
    "OutputFile",
    "PathOutsideWorkspace",
    "PayloadTooLarge",
    "ProtocolError",
    "QuotaExceeded",
    "ResponseTimeout",
    "RetryPolicy",
    "SandboxFailed",
    "SandpoolClientError",
    "ServerError",
    "Session",
    "SessionInfo",
    "Unauthorized",
    "Unavailable",
    "UploadResult",
]
