"""Streamed Execute: the events a call sends while it runs, parsed from server-sent events.

sandpool answers an Execute sent with `Accept: text/event-stream` with `stdout` and
`stderr` events (`data: {"text": ...}`) as the program writes, heartbeat comments
while it is silent, then one `result` event holding the very body a plain Execute
returns (or an `error` event when the call could not run once the stream began).
A backend without streaming answers the plain JSON body: it reads as the whole
output at once, then the result, so code written against the stream works anywhere.
No I/O here: the sync and async clients feed lines in.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

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


class EventReader:
    """Turns the stream's lines (without their line ends) into `ExecEvent`s; raises the error an
    `error` event stands for, and `ProtocolError` for what no sandpool server sends."""

    def __init__(self) -> None:
        self._name = ""
        self._data: list[str] = []
        self.finished = False

    def line(self, line: str) -> ExecEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None  # a comment: a heartbeat
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "event":
            self._name = value
        elif field == "data":
            self._data.append(value)
        return None

    def _dispatch(self) -> ExecEvent | None:
        name, data = self._name or "message", "\n".join(self._data)
        self._name, self._data = "", []
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


__all__ = ["CANCEL_ON_DISCONNECT_HEADER", "EventReader", "ExecEvent", "OutputCallback", "deliver", "events_of",
           "is_event_stream", "stream_headers"]
