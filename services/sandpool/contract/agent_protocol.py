"""The names the agent, the api and the client share beyond the JSON models.

Two protocols, each spelled once here:

- **api <-> agent**: the agent answers an Execute with the call's outcome
  label in `OUTCOME_HEADER` (a streamed one in an `: outcome <label>` comment
  before its result event); the api consumes it, meters the call on it and
  counts it in `sandpool_executions_total{outcome}`. The labels are `Outcome`.
- **the session fence**: an agent serves the first session id a call names and
  refuses any other with 409 and `FENCED_HEADER` (DESIGN.md, "Redis"); the sandbox
  then ends. The api releases the refused session as dead and answers it 503
  `sandbox_unavailable` (the call did not run, the session is gone).
- **streamed Execute** (docs/api.md "Streaming"): `Accept: text/event-stream`
  asks for server-sent events named `Event`, with `: heartbeat` comments while the
  call is silent; `CANCEL_ON_DISCONNECT_HEADER: true` makes a disconnect cancel the call.

HTTP header names are case-insensitive: code that compares raw ASGI headers uses
`lower_name(...)` of these constants, never a second spelling.
"""

from __future__ import annotations

from enum import StrEnum

OUTCOME_HEADER = "X-Sandpool-Outcome"
"""The agent's response header carrying the call's `Outcome` (consumed by the api, never relayed)."""


FENCED_HEADER = "X-Sandpool-Fenced"
"""The agent's response header on a call refused by its session fence (409): `true`. The sandbox serves
another session and is ending (consumed by the api, never relayed)."""
FENCED_STATUS = 409
"""The status of a fenced refusal."""


class Outcome(StrEnum):
    """How a call ended, as the agent reports it: the closed label set of the executions metric."""

    OK = "ok"
    FAILED = "failed"
    TIMEOUT = "timeout"
    LIMIT = "limit"
    CANCELLED = "cancelled"
    WITHDRAWN = "withdrawn"
    """Cancelled while it waited for its turn: it never ran (and is not metered as an execution)."""


EVENT_STREAM = "text/event-stream"
"""The media type a client names in `Accept` to get a streamed Execute."""
EVENT_STREAM_CONTENT_TYPE = EVENT_STREAM + "; charset=utf-8"
"""The `Content-Type` of a streamed answer."""
CANCEL_ON_DISCONNECT_HEADER = "Sandpool-Cancel-On-Disconnect"
"""Request header: `true` makes a streamed call's disconnect cancel the call."""
CALL_ID_HEADER = "Sandpool-Call-Id"
"""Request header of an Execute to the agent: the id the api gave the call, which a cancel names
(`DELETE /sessions/{id}/exec?call_id=...`) so that it stops that call and no other."""
TRUE_VALUES = ("true", "1", "yes")
"""The values of a boolean request header that mean true (compared in lower case)."""


class Event(StrEnum):
    """The names of a streamed Execute's server-sent events."""

    STDOUT = "stdout"
    STDERR = "stderr"
    RESULT = "result"
    ERROR = "error"


OUTPUT_EVENTS = (Event.STDOUT, Event.STDERR)
"""The events carrying a piece of the program's output (`data: {"text": ...}`)."""
HEARTBEAT_COMMENT = "heartbeat"
"""The comment (`: heartbeat`) sent while a call is silent, so idle proxies keep the connection."""
OUTCOME_COMMENT = "outcome"
"""The comment (`: outcome <label>`) the agent sends before a streamed result; the api drops it."""


def lower_name(header: str) -> bytes:
    """A header name as ASGI carries it (lower case, bytes), for comparing raw headers."""
    return header.lower().encode("latin-1")


__all__ = ["CALL_ID_HEADER", "CANCEL_ON_DISCONNECT_HEADER", "EVENT_STREAM", "EVENT_STREAM_CONTENT_TYPE",
           "FENCED_HEADER", "FENCED_STATUS", "HEARTBEAT_COMMENT", "OUTCOME_COMMENT", "OUTCOME_HEADER",
           "OUTPUT_EVENTS", "TRUE_VALUES", "Event", "Outcome", "lower_name"]
