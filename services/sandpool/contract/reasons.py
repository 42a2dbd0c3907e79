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

`EgressRefusal` holds the egress proxy's refusal words (`X-Sandpool-Egress-Refusal`,
docs/egress.md), which sandboxed programs see instead of an error body: outside the
API, so a catalogue of their own (`EGRESS_REFUSALS`, each word's statuses), which the
egress proxy and the sandbox's relay name them from.

Not here: the `cause` of a refused credential (the edge's closed set, docs/api.md
"Authentication"), a finer word under `unauthorized`.
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
    Reason.TENANCY_MISSING: Entry(403, "retired: the scheduler got a call without the proxy's credential or a "
                                       "tenancy header"),
    Reason.TENANCY_INVALID: Entry(403, "retired: the scheduler got a tenancy header it could not read"),
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
    Reason.SCHEDULER_UNAVAILABLE: Entry(503, "retired: the proxy could not reach the scheduler"),
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


class EgressRefusal(StrEnum):
    """A word of `X-Sandpool-Egress-Refusal` and of the `reason` label of `sandpool_egress_refusals_total`."""

    NO_CREDENTIAL = "no_credential"
    BAD_CREDENTIAL = "bad_credential"
    UNKNOWN_CREDENTIAL = "unknown_credential"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    TOO_MANY_WORKSPACE_CONNECTIONS = "too_many_workspace_connections"
    NOT_ALLOWED = "not_allowed"
    ABOVE_CEILING = "above_ceiling"
    ADDRESS_REFUSED = "address_refused"
    BAD_DESTINATION = "bad_destination"
    RESOLVE_FAILED = "resolve_failed"
    CONNECT_FAILED = "connect_failed"
    CONNECT_TIMEOUT = "connect_timeout"
    HEAD_TOO_LARGE = "head_too_large"
    HEAD_TIMEOUT = "head_timeout"
    BAD_REQUEST = "bad_request"
    SCHEME_REFUSED = "scheme_refused"
    NOT_PROXY_REQUEST = "not_proxy_request"
    BAD_RESPONSE = "bad_response"
    UNAVAILABLE = "unavailable"
    SNI_MISMATCH = "sni_mismatch"
    SNI_MISSING = "sni_missing"
    SNI_ENCRYPTED = "sni_encrypted"
    NOT_TLS = "not_tls"
    HELLO_TIMEOUT = "hello_timeout"
    HELLO_INCOMPLETE = "hello_incomplete"
    PROXY_UNREACHABLE = "proxy_unreachable"
    PROXY_BUSY = "proxy_busy"


@dataclass(frozen=True)
class EgressEntry:
    """An egress refusal word's HTTP statuses (several: the refusal says which; none: a tunnel cut at its
    ClientHello, which gets no HTTP answer) and its meaning, one line."""

    statuses: tuple[int, ...]
    meaning: str


EGRESS_REFUSALS: Mapping[EgressRefusal, EgressEntry] = {
    EgressRefusal.NO_CREDENTIAL: EgressEntry((407,), "no Proxy-Authorization"),
    EgressRefusal.BAD_CREDENTIAL: EgressEntry((407,), "a Proxy-Authorization that is not Basic with a credential"),
    EgressRefusal.UNKNOWN_CREDENTIAL: EgressEntry((407,), "a credential bound to no live session"),
    EgressRefusal.TOO_MANY_CONNECTIONS: EgressEntry((429, 503), "the sandbox holds its share of connections "
                                                                "(429), or the proxy all it serves (503)"),
    EgressRefusal.TOO_MANY_WORKSPACE_CONNECTIONS: EgressEntry((429,), "the workspace's sandboxes hold its cap "
                                                                      "(policy max_egress_connections)"),
    EgressRefusal.NOT_ALLOWED: EgressEntry((403,), "the destination is not on the session's allow-list"),
    EgressRefusal.ABOVE_CEILING: EgressEntry((403,), "the destination is outside the operator's ceiling"),
    EgressRefusal.ADDRESS_REFUSED: EgressEntry((403,), "the destination is or resolves to a refused address"),
    EgressRefusal.BAD_DESTINATION: EgressEntry((400,), "a malformed destination"),
    EgressRefusal.RESOLVE_FAILED: EgressEntry((502,), "the destination's name does not resolve"),
    EgressRefusal.CONNECT_FAILED: EgressEntry((502,), "the destination refused the connection"),
    EgressRefusal.CONNECT_TIMEOUT: EgressEntry((504,), "connecting to the destination timed out"),
    EgressRefusal.HEAD_TOO_LARGE: EgressEntry((431,), "a request head over the size or line limit"),
    EgressRefusal.HEAD_TIMEOUT: EgressEntry((408,), "the request head did not arrive in time"),
    EgressRefusal.BAD_REQUEST: EgressEntry((400, 501), "a malformed request (501: a transfer coding other than "
                                                      "chunked)"),
    EgressRefusal.SCHEME_REFUSED: EgressEntry((405,), "an absolute URL of a scheme other than http"),
    EgressRefusal.NOT_PROXY_REQUEST: EgressEntry((405,), "neither CONNECT nor an absolute URL, nor a probe"),
    EgressRefusal.BAD_RESPONSE: EgressEntry((502,), "the origin did not answer a plain request in HTTP/1.x"),
    EgressRefusal.UNAVAILABLE: EgressEntry((503,), "Redis cannot be reached to check the credential"),
    EgressRefusal.SNI_MISMATCH: EgressEntry((), "the ClientHello's SNI names another host than the CONNECT"),
    EgressRefusal.SNI_MISSING: EgressEntry((), "the ClientHello of a tunnel to a name carries no SNI"),
    EgressRefusal.SNI_ENCRYPTED: EgressEntry((), "the ClientHello offers Encrypted Client Hello"),
    EgressRefusal.NOT_TLS: EgressEntry((), "the tunnel's first bytes are not a well-formed ClientHello"),
    EgressRefusal.HELLO_TIMEOUT: EgressEntry((), "the ClientHello did not arrive in time"),
    EgressRefusal.HELLO_INCOMPLETE: EgressEntry((), "the client closed before its ClientHello was complete"),
    EgressRefusal.PROXY_UNREACHABLE: EgressEntry((502,), "a local sandbox's relay finds nothing listening at the "
                                                         "proxy's socket"),
    EgressRefusal.PROXY_BUSY: EgressEntry((503,), "a local sandbox's relay found the proxy's listen queue full "
                                                  "for its whole wait"),
}


def status_of(reason: Reason) -> int | None:
    """The HTTP status a reason always comes with, or None when it varies."""
    return CATALOGUE[reason].status


__all__ = ["CATALOGUE", "EGRESS_REFUSALS", "ClientReason", "EgressEntry", "EgressRefusal", "Entry", "Reason",
           "status_of"]
