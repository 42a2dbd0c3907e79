"""Streamed Execute: the events a call sends while it runs, parsed from server-sent events.

sandpool answers an Execute sent with `Accept: text/event-stream` with `stdout` and
`stderr` events (`data: {"text": ...}`) as the program writes, heartbeat comments
while it is silent, then one `result` event holding the very body a plain Execute
returns (or an `error` event when the call could not run once the stream began).
A backend without streaming answers the plain JSON body: it reads as the whole
output at once, then the result, so code written against the stream works anywhere.
The stream is parsed by `httpx-sse`, as the SSE specification says: lines end only at CR, LF
and CRLF. (httpx's `iter_lines()` also ends them at U+2028, U+2029, U+0085 and the other
`str.splitlines()` boundaries, which cut an event holding such output in two.)
No I/O here: the sync and async clients read the response and feed the events in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent

from sandpool.client.errors import ProtocolError, SandpoolClientError, error_from_response
from sandpool.client.results import ExecResult
from sandpool.contract.agent_protocol import CANCEL_ON_DISCONNECT_HEADER, EVENT_STREAM, OUTPUT_EVENTS, Event

OutputCallback = Callable[[str], None]


@dataclass(frozen=True)
class ExecEvent:
    """One event of a streamed Execute: `type` is `stdout`, `stderr` (with `text`, a piece of the
    output as written) or `result` (the last one, with the whole `result`, as a plain Execute returns it).
    The texts of a call's `stdout` events put together are exactly `result.stdout` (truncation marker and
    notes included); the same for stderr."""

    type: str
    text: str = ""
    result: ExecResult | None = None


def stream_headers(cancel_on_disconnect: bool) -> dict[str, str]:
    headers = {"Accept": EVENT_STREAM}
    if cancel_on_disconnect:
        headers[CANCEL_ON_DISCONNECT_HEADER] = "true"
    return headers


def is_event_stream(resp: httpx.Response) -> bool:
    return resp.status_code == 200 and resp.headers.get("content-type", "").startswith(EVENT_STREAM)


def event_source(resp: httpx.Response) -> EventSource:
    """The response's server-sent events. An event stream is UTF-8 whatever its header says (the
    specification), so a charset in Content-Type does not change how it decodes."""
    resp.encoding = "utf-8"
    return EventSource(resp)


class EventReader:
    """Turns the stream's server-sent events into `ExecEvent`s; raises the error an `error` event
    stands for, and `ProtocolError` for what no sandpool server sends."""

    def __init__(self) -> None:
        self.finished = False

    def event(self, sse: ServerSentEvent) -> ExecEvent | None:
        name, data = sse.event, sse.data
        if not data:
            return None
        try:
            body: Any = json.loads(data)
        except ValueError as exc:
            raise ProtocolError(f"a streamed Execute sent a {name!r} event whose data is not JSON") from exc
        if name in OUTPUT_EVENTS:
            text = body.get("text") if isinstance(body, dict) else None
            if not isinstance(text, str):
                raise ProtocolError(f"a streamed Execute sent a {name!r} event without its text")
            return ExecEvent(str(Event(name)), text=text)
        if name == Event.RESULT:
            self.finished = True
            return ExecEvent(str(Event.RESULT), result=ExecResult.from_body(body))
        if name == Event.ERROR:
            self.finished = True
            raise error_of(body)
        return None  # an event a newer server added: ignored, as the contract's extension policy asks


def error_of(body: Any) -> SandpoolClientError:
    """The exception an `error` event stands for (its data is an error body plus its `status`)."""
    if not isinstance(body, dict) or not isinstance(body.get("status"), int):
        return ProtocolError("a streamed Execute sent an error event without its status")
    return error_from_response(body["status"], httpx.Headers(), body)


def events_of(result: ExecResult) -> Iterator[ExecEvent]:
    """A whole (non-streamed) result as the events a stream would have sent."""
    if result.stdout:
        yield ExecEvent(str(Event.STDOUT), text=result.stdout)
    if result.stderr:
        yield ExecEvent(str(Event.STDERR), text=result.stderr)
    yield ExecEvent(str(Event.RESULT), result=result)


def deliver(event: ExecEvent, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None) -> None:
    if event.type == Event.STDOUT and on_stdout is not None:
        on_stdout(event.text)
    elif event.type == Event.STDERR and on_stderr is not None:
        on_stderr(event.text)


__all__ = ["CANCEL_ON_DISCONNECT_HEADER", "EventReader", "ExecEvent", "OutputCallback", "deliver", "event_source",
           "events_of", "is_event_stream", "stream_headers"]
