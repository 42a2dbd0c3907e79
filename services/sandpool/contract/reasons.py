"""The catalogue of error reasons: every `reason` an error body can carry, declared once.

Every error sandpool answers has one body shape, `{"detail": ..., "reason": ...}`;
`detail` is for people, `reason` is the stable word a client branches on. Each
reason is a member of `Reason` (its value is the wire string), and `CATALOGUE`
gives its HTTP status (None where the status varies) and what it means. The
services' error classes name their reason from here (`reason = Reason.AT_CAPACITY`),
the client maps reasons to its exceptions from here, and `docs/api.md` lists them
all (tests/unit/test_reasons.py keeps the three in step).

`ClientReason` holds the few reasons the Python client sets itself when no
response (or no sandpool error body) told it one: they never travel on the wire.

Not here: the `cause` of a refused credential (the proxy's closed set, docs/api.md
"Authentication") and the egress proxy's `X-Sandpool-Egress-Refusal` words
(docs/egress.md): both are finer words under one of these reasons or outside the
API altogether.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Reason(StrEnum):
    """A wire reason; the member's value is the string in the error body."""

    BAD_REQUEST = "bad_request"
    UNKNOWN_TOOL_KIND = "unknown_tool_kind"
    IS_A_DIRECTORY = "is_a_directory"
    NOT_A_REGULAR_FILE = "not_a_regular_file"
    NAME_TOO_LONG = "name_too_long"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    IMAGE_NOT_ALLOWED = "image_not_allowed"
    PATH_OUTSIDE_WORKSPACE = "path_outside_workspace"
    TENANCY_MISSING = "tenancy_missing"
    TENANCY_INVALID = "tenancy_invalid"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONFLICT = "conflict"
    NO_RUNNING_CALL = "no_running_call"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INVALID_REQUEST = "invalid_request"
    QUOTA_EXCEEDED = "quota_exceeded"
    CLIENT_CLOSED_REQUEST = "client_closed_request"
    INTERNAL_ERROR = "internal_error"
    HTTP_ERROR = "http_error"
    SANDBOX_FAILED = "sandbox_failed"
    SESSION_ENDED = "session_ended"
    AT_CAPACITY = "at_capacity"
    START_TIMEOUT = "start_timeout"
    UNAVAILABLE = "unavailable"
    REDIS_UNAVAILABLE = "redis_unavailable"
    SCHEDULER_UNAVAILABLE = "scheduler_unavailable"
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"
    WORKSPACE_FULL = "workspace_full"


@dataclass(frozen=True)
class Entry:
    """A reason's HTTP status (None: it varies) and its meaning, one line."""

    status: int | None
    meaning: str


CATALOGUE: Mapping[Reason, Entry] = {
    Reason.BAD_REQUEST: Entry(400, "the request is wrong in a way no finer reason names"),
    Reason.UNKNOWN_TOOL_KIND: Entry(400, "an Execute whose `tool` names no known kind"),
    Reason.IS_A_DIRECTORY: Entry(400, "a directory where a file was expected"),
    Reason.NOT_A_REGULAR_FILE: Entry(400, "a device, socket or FIFO where a regular file was expected"),
    Reason.NAME_TOO_LONG: Entry(400, "a file name too long for the sandbox's file system"),
    Reason.UNAUTHORIZED: Entry(401, "the bearer token is missing or refused (the body's `cause` says why)"),
    Reason.FORBIDDEN: Entry(403, "not allowed: an admin-only call, or another workspace's data"),
    Reason.IMAGE_NOT_ALLOWED: Entry(403, "the workspace's policy does not allow the requested `image`"),
    Reason.PATH_OUTSIDE_WORKSPACE: Entry(403, "a file path that escapes the session's workspace"),
    Reason.TENANCY_MISSING: Entry(403, "the scheduler got a call without the proxy's credential or a tenancy header"),
    Reason.TENANCY_INVALID: Entry(403, "the scheduler got a tenancy header it cannot read"),
    Reason.NOT_FOUND: Entry(404, "no such session (or another workspace's), file or path"),
    Reason.METHOD_NOT_ALLOWED: Entry(405, "the path exists but not with this method"),
    Reason.CONFLICT: Entry(409, "the call conflicts with the state it finds"),
    Reason.NO_RUNNING_CALL: Entry(409, "CancelExecution found no code or bash call running"),
    Reason.PAYLOAD_TOO_LARGE: Entry(413, "the body or upload is over the cap; nothing was written"),
    Reason.INVALID_REQUEST: Entry(422, "a malformed body, or a tool input missing its fields"),
    Reason.QUOTA_EXCEEDED: Entry(429, "the workspace's own quota, rate or budget (`limit` says which)"),
    Reason.CLIENT_CLOSED_REQUEST: Entry(499, "the caller left while it waited; logged, never read"),
    Reason.INTERNAL_ERROR: Entry(500, "a defect in sandpool; the call may not have run"),
    Reason.HTTP_ERROR: Entry(None, "another HTTP error of the web framework, with its own status"),
    Reason.SANDBOX_FAILED: Entry(502, "the session's sandbox died or broke the call: the session is gone"),
    Reason.SESSION_ENDED: Entry(502, "the session was destroyed or reaped during a streamed call"),
    Reason.AT_CAPACITY: Entry(503, "the pool is full; nothing was leased"),
    Reason.START_TIMEOUT: Entry(503, "no sandbox could be started within the capacity wait; nothing was leased"),
    Reason.UNAVAILABLE: Entry(503, "the call cannot be served now (a queue is full, the interpreter cannot start)"),
    Reason.REDIS_UNAVAILABLE: Entry(503, "Redis cannot be reached"),
    Reason.SCHEDULER_UNAVAILABLE: Entry(503, "the proxy cannot reach the scheduler"),
    Reason.SANDBOX_UNAVAILABLE: Entry(503, "the session's sandbox cannot be reached: the call did not run, the session "
                                           "is gone"),
    Reason.WORKSPACE_FULL: Entry(503, "the workspace's disk is full; nothing was written"),
}


class ClientReason(StrEnum):
    """The reasons the Python client sets itself; never sent by a server."""

    CONNECTION_FAILED = "connection_failed"
    CONNECTION_LOST = "connection_lost"
    RESPONSE_TIMEOUT = "response_timeout"
    PROTOCOL_ERROR = "protocol_error"
    SERVER_ERROR = "server_error"


def status_of(reason: Reason) -> int | None:
    """The HTTP status a reason always comes with, or None when it varies."""
    return CATALOGUE[reason].status


__all__ = ["CATALOGUE", "ClientReason", "Entry", "Reason", "status_of"]
