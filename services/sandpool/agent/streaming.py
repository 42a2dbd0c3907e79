"""Server-sent events of a running call: sandpool's streaming Execute, produced where the output is.

With `Accept: text/event-stream`, a code or bash call answers `200 text/event-stream` at
once and then sends, in this order:

- `event: stdout` / `event: stderr` with `data: {"text": "..."}`: the output the result
  keeps (the per-stream cap applies), decoded as the result decodes it, as it arrives;
  stdout and stderr pieces go out in the order the agent read them;
- `: heartbeat` comment lines while nothing else was sent for the heartbeat interval;
- at the end, the pieces the result adds (a truncation marker, the timeout or cancel
  note), so that the texts of a stream's events put together are exactly the result's
  `stdout` and `stderr`; then `: outcome <label>` (read and dropped by the api,
  which meters the call on it), then `event: result` whose data is exactly the JSON body
  the non-streaming call would have answered;
- or, when the call could not run after the stream began, `event: error` with the error
  body plus its `status`.

Output is never queued without bound: only kept bytes (at most the cap per stream) wait
for a slow reader, and they wait merged.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
from collections.abc import Iterator
from typing import Any

from starlette.types import Receive, Send

from sandpool.contract import agent_protocol as protocol
from sandpool.contract.agent_protocol import EVENT_STREAM, OUTPUT_EVENTS, Event
from sandpool.core.errors import SandpoolError

log = logging.getLogger("sandpool.agent.streaming")

PIECE_BYTES = 16 * 1024
"""UTF-8 bytes of text per event at most (docs/api.md): with JSON escaping an event stays under
100 KiB (the api's check)."""
_DECODE_BYTES = 4 * PIECE_BYTES
"""Bytes read decoded at once when sending them."""
HEADERS = [(b"content-type", protocol.EVENT_STREAM_CONTENT_TYPE.encode()), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no")]
HEARTBEAT = b": %s\n\n" % protocol.HEARTBEAT_COMMENT.encode()
CANCEL_ON_DISCONNECT = protocol.lower_name(protocol.CANCEL_ON_DISCONNECT_HEADER)
"""The cancel-on-disconnect request header, as ASGI spells it."""
_TRUE = tuple(value.encode() for value in protocol.TRUE_VALUES)


def wants_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    """The request's Accept names text/event-stream."""
    for name, value in headers:
        if name.lower() == b"accept" and EVENT_STREAM.encode() in value.lower():
            return True
    return False


def pieces(text: str, limit: int = PIECE_BYTES) -> Iterator[str]:
    """`text` in consecutive pieces of at most `limit` bytes of UTF-8 each, cut between characters.

    Cut by encoded bytes, not by characters or by the bytes read: a character is up to 4 bytes,
    and each invalid byte read becomes U+FFFD, 3 bytes of text. `limit` is at least 4.
    """
    data = text.encode()
    start = 0
    while len(data) - start > limit:
        end = start + limit
        while data[end] & 0xC0 == 0x80:  # a continuation byte: the cut would split a character
            end -= 1
        yield data[start:end].decode()
        start = end
    if start < len(data):
        yield data[start:].decode()


def header_true(headers: list[tuple[bytes, bytes]], name: bytes) -> bool:
    for key, value in headers:
        if key.lower() == name:
            return value.strip().lower() in _TRUE
    return False


def event(name: Event, data: Any) -> bytes:
    """One SSE event; `data` as compact JSON on one line (JSON never holds a raw newline)."""
    return json_event(name, json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode())


def json_event(name: Event, data: bytes) -> bytes:
    """One SSE event whose data is already compact JSON (one line)."""
    return b"event: %s\ndata: %s\n\n" % (name.encode(), data)


def error_event(exc: SandpoolError) -> bytes:
    return event(Event.ERROR, {**exc.body(), "status": exc.status_code})


class OutputEvents:
    """The output of one call, turned into events as it arrives and sent by `pump`."""

    def __init__(self, send: Send, heartbeat_seconds: float) -> None:
        self._send = send
        self.heartbeat_seconds = heartbeat_seconds
        self._pending: list[tuple[Event, bytearray]] = []
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")(errors="replace") for name in OUTPUT_EVENTS}
        self._emitted = dict.fromkeys(OUTPUT_EVENTS, 0)  # characters of each stream's text sent so far
        self.wake = asyncio.Event()
        self.gone = False
        """The reader left: nothing is sent any more (the call itself is not stopped here)."""

    def on_output(self, name: str, data: bytes) -> None:
        """Called by the worker's readers with the bytes the result keeps (`name`: stdout or stderr)."""
        if self.gone:
            return
        stream = Event(name)
        if self._pending and self._pending[-1][0] == stream:
            self._pending[-1][1].extend(data)
        else:
            self._pending.append((stream, bytearray(data)))
        self.wake.set()

    async def write(self, data: bytes) -> None:
        if not self.gone:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def flush(self) -> None:
        """Send what is pending (merged per stream, in arrival order), in pieces of at most
        PIECE_BYTES of text. Decoded a slice at a time, so a backlog as large as the output cap never
        exists as text all at once; a slice's last, short piece waits to be filled by the next."""
        while self._pending:
            stream, data = self._pending.pop(0)
            if self.gone:
                continue
            decoder, text = self._decoders[stream], ""
            for start in range(0, len(data), _DECODE_BYTES):
                decoded = decoder.decode(bytes(data[start:start + _DECODE_BYTES]))
                self._emitted[stream] += len(decoded)
                cut = list(pieces(text + decoded))
                text = cut.pop() if cut and start + _DECODE_BYTES < len(data) else ""
                for piece in cut:
                    await self.write(event(stream, {"text": piece}))

    async def pump(self, work: asyncio.Future[Any], gone: asyncio.Future[Any], on_gone: Any) -> None:
        """Send output as it comes and heartbeats while silent, until `work` ends. `on_gone()` runs
        once when the reader leaves (`gone` resolves)."""
        work.add_done_callback(lambda _: self.wake.set())
        gone.add_done_callback(lambda _: self.wake.set())
        while True:
            try:
                async with asyncio.timeout(self.heartbeat_seconds):
                    await self.wake.wait()
            except TimeoutError:
                await self.write(HEARTBEAT)
                continue
            self.wake.clear()
            if gone.done() and not self.gone:
                self.gone = True
                self._pending.clear()
                on_gone()
            await self.flush()
            if work.done():
                return

    async def finish(self, stdout: str, stderr: str, body: bytes, outcome: str) -> None:
        """The rest of the result's text, the outcome for the api, the result event (`body`: the
        non-streaming answer's exact JSON bytes); end."""
        await self.flush()
        for stream, text in ((Event.STDOUT, stdout), (Event.STDERR, stderr)):
            # What was sent is a prefix of the result's text (the same kept bytes, decoded alike);
            # the rest is a trailing partial character, the truncation marker and the notes.
            for piece in pieces(text[self._emitted[stream]:]):
                await self.write(event(stream, {"text": piece}))
        comment = b": %s %s\n\n" % (protocol.OUTCOME_COMMENT.encode(), outcome.encode())
        await self.write(comment + json_event(Event.RESULT, body))
        await self.end()

    async def fail(self, exc: SandpoolError) -> None:
        await self.flush()
        await self.write(error_event(exc))
        await self.end()

    async def end(self) -> None:
        if not self.gone:
            await self._send({"type": "http.response.body", "body": b"", "more_body": False})


async def disconnected(receive: Receive) -> None:
    """Return when the reader disconnects (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


__all__ = ["CANCEL_ON_DISCONNECT", "EVENT_STREAM", "HEADERS", "OutputEvents", "disconnected", "error_event", "event",
           "header_true", "json_event", "pieces", "wants_stream"]
