"""Relaying an agent's event stream (a streamed Execute) to the client, checked and metered.

The agent's stream is read by a task of its own (`StreamRelay.pump`), not by the
response: a client that leaves mid-stream must not stop the metering of a call
that goes on running in the sandbox, nor its session's one-call-at-a-time order
(the agent holds its call lock until the call ends). The pump:

- parses the agent's events strictly (`AgentEvents`): only `stdout`, `stderr`,
  `result` and `error` events with one JSON `data` line, and the `heartbeat` and
  `outcome` comments; an event over its size bound or anything else ends the stream
  as a failed sandbox (a compromised agent cannot feed the client garbage, nor make
  the api buffer without bound);
- relays each event as soon as it is parsed through a small bounded queue, so a slow
  client slows the agent down (backpressure down to the sandbox's pipe) instead of
  growing memory here;
- consumes the `: outcome` comment and meters the call on it before it relays the
  `result` event: a client holding the result also sees the usage it caused;
- once the client is gone, reads on and discards, so the call is metered when it
  ends; with `Sandpool-Cancel-On-Disconnect: true` it first asks the agent to
  cancel the call.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sandpool.contract import agent_protocol as protocol
from sandpool.contract.agent_protocol import Event, Outcome
from sandpool.contract.reasons import Reason, status_of

log = logging.getLogger(__name__)

EVENT_STREAM = protocol.EVENT_STREAM.encode()
CANCEL_ON_DISCONNECT = protocol.lower_name(protocol.CANCEL_ON_DISCONNECT_HEADER)
_TRUE = tuple(value.encode() for value in protocol.TRUE_VALUES)
MAX_EVENT_BYTES = 256 * 1024
"""An output event's bound: the agent sends at most 16 KiB of output per event (under 100 KiB escaped)."""
MAX_RESULT_EVENT_BYTES = 32 * 1024 * 1024
"""The result event's bound: the result block with both streams at a 1 MiB cap takes a few MiB at most."""
QUEUE_EVENTS = 8
"""Events parsed ahead of a slow client; past it the pump stops reading from the agent."""
OUTPUT_EVENTS = tuple(name.encode() for name in protocol.OUTPUT_EVENTS)
RESULT_EVENT = Event.RESULT.encode()
ERROR_EVENT = Event.ERROR.encode()
HEARTBEAT = b": " + protocol.HEARTBEAT_COMMENT.encode()
OUTCOME = b": %s " % protocol.OUTCOME_COMMENT.encode()
HEADERS = [(b"content-type", protocol.EVENT_STREAM_CONTENT_TYPE.encode()), (b"cache-control", b"no-cache"),
           (b"x-accel-buffering", b"no")]


class MalformedStream(Exception):
    """The agent's stream is not what sandpool's agent sends."""


def wants_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == b"accept" and EVENT_STREAM in value.lower() for name, value in headers)


def cancel_on_disconnect(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == CANCEL_ON_DISCONNECT and value.strip().lower() in _TRUE for name, value in headers)


def error_event(reason: Reason, detail: str) -> bytes:
    """An `error` event: the error body plus the status its reason always comes with."""
    status = status_of(reason)
    assert status is not None, f"{reason} has no fixed status"
    data = json.dumps({"detail": detail, "reason": reason, "status": status}, separators=(",", ":"))
    return b"event: %s\ndata: %s\n\n" % (ERROR_EVENT, data.encode())


class AgentEvents:
    """A strict, bounded parser of the agent's event stream: `feed` bytes, get `(kind, value, raw)`
    tuples: ("heartbeat", None, raw), ("outcome", label, b""), ("stdout"|"stderr"|"result"|"error",
    the decoded data, the event's bytes to relay)."""

    def __init__(self, *, max_event_bytes: int = MAX_EVENT_BYTES,
                 max_result_bytes: int = MAX_RESULT_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self.max_result_bytes = max_result_bytes
        self._buf = bytearray()
        self._scanned = 0

    def feed(self, data: bytes) -> list[tuple[str, Any, bytes]]:
        self._buf += data
        events: list[tuple[str, Any, bytes]] = []
        while True:
            end = self._buf.find(b"\n\n", max(0, self._scanned - 1))
            if end < 0:
                self._scanned = len(self._buf)
                limit = (self.max_result_bytes if self._buf.startswith(b"event: %s\n" % RESULT_EVENT)
                         else self.max_event_bytes)
                if len(self._buf) > limit:
                    raise MalformedStream("an event over its size bound")
                return events
            block = bytes(self._buf[:end])
            del self._buf[:end + 2]
            self._scanned = 0
            events.append(self._parse(block))

    @property
    def pending(self) -> bool:
        return bool(self._buf)

    def _parse(self, block: bytes) -> tuple[str, Any, bytes]:
        if b"\r" in block:
            raise MalformedStream("a carriage return in an event")
        if block == HEARTBEAT:
            return "heartbeat", None, block + b"\n\n"
        if block.startswith(OUTCOME):
            label = block[len(OUTCOME):].decode("ascii", errors="replace")
            return "outcome", label, b""
        lines = block.split(b"\n")
        if len(lines) != 2 or not lines[0].startswith(b"event: ") or not lines[1].startswith(b"data: "):
            raise MalformedStream("an event that is not one event line and one data line")
        name = lines[0][len(b"event: "):]
        limit = self.max_result_bytes if name == RESULT_EVENT else self.max_event_bytes
        if len(block) > limit:
            raise MalformedStream("an event over its size bound")
        try:
            data = json.loads(lines[1][len(b"data: "):])
        except ValueError:
            raise MalformedStream("event data that is not JSON") from None
        if not isinstance(data, dict):
            raise MalformedStream("event data that is not a JSON object")
        if name in OUTPUT_EVENTS:
            if not isinstance(data.get("text"), str):
                raise MalformedStream("an output event without its text")
        elif name == ERROR_EVENT:
            if not isinstance(data.get("status"), int) or not isinstance(data.get("reason"), str):
                raise MalformedStream("an error event without status and reason")
        elif name != RESULT_EVENT:
            raise MalformedStream("an unknown event")
        return name.decode(), data, block + b"\n\n"


Meter = Callable[[str], Awaitable[None]]
"""Meter the call with the agent's outcome label (and mark the session active)."""


class StreamRelay:
    """One streamed call: the pump reading the agent, and the queue the client's response reads."""

    def __init__(self, chunks: Any, *, meter: Meter, unmetered: Callable[[], Awaitable[None]],
                 dead: Callable[[], Awaitable[None]], ended: Callable[[], None],
                 cancel: Callable[[], Awaitable[None]], cancel_on_disconnect: bool, deadline: float) -> None:
        self._chunks = chunks
        self._meter = meter
        self._unmetered = unmetered
        self._dead = dead
        self._ended = ended
        self._cancel = cancel
        self.cancel_on_disconnect = cancel_on_disconnect
        self.deadline = deadline
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_EVENTS)
        self.detached = False
        self.metered = False
        self._cancelling: asyncio.Task[None] | None = None

    async def _put(self, item: bytes | None) -> None:
        if not self.detached:
            await self.queue.put(item)

    def detach(self) -> None:
        """The client left: stop queueing; cancel the call if it asked for that."""
        if self.detached:
            return
        self.detached = True
        while not self.queue.empty():
            self.queue.get_nowait()
        if self.cancel_on_disconnect and not self.metered:
            self._cancelling = asyncio.ensure_future(self._cancel())

    async def pump(self) -> None:
        """Read the agent's stream to its end (whatever the client does), relay, meter once."""
        parser = AgentEvents()
        finished = False
        try:
            async with asyncio.timeout(self.deadline):
                async for chunk in self._chunks:
                    for kind, value, raw in parser.feed(chunk):
                        if finished:
                            continue  # nothing follows the last event: ignored, never relayed
                        if kind == "outcome":
                            await self._meter_once(value)
                        elif kind in (Event.RESULT, Event.ERROR):
                            if kind == Event.RESULT:
                                await self._meter_once(Outcome.OK)  # (the agent always says its outcome first)
                            else:
                                await self._unmetered_once()
                            await self._put(raw)
                            await self._put(None)  # the client's answer is whole; the agent's ends now
                            finished = True
                        else:
                            await self._put(raw)
            if not finished or parser.pending:
                raise MalformedStream("the stream ended before its result")
        except asyncio.CancelledError:
            if not finished:  # the session was released under the call (or the api is stopping)
                self._ended()
                await self._unmetered_once()
                await self._put_nowait(error_event(Reason.SESSION_ENDED, "the session was released while the "
                                                                         "call ran; the session is gone"))
                await self._put_nowait(None)
            raise
        except Exception as exc:  # noqa: BLE001 - a broken stream (malformed, cut, overdue), whatever broke it
            if not finished:
                log.warning("sandbox failed mid-stream", extra={"error": type(exc).__name__, "detail": str(exc)})
                self.metered = True  # the release ends the session: there is nothing to mark active
                await self._dead()
                await self._put(error_event(Reason.SANDBOX_FAILED,
                                            "the session's sandbox failed during the call; the session is gone"))
                await self._put(None)
        finally:
            if self._cancelling is not None:
                await asyncio.gather(self._cancelling, return_exceptions=True)

    async def _put_nowait(self, item: bytes | None) -> None:
        if self.detached:
            return
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            if item is None:
                await self.queue.put(None)

    async def _meter_once(self, outcome: str) -> None:
        if not self.metered:
            self.metered = True
            await self._meter(outcome)

    async def _unmetered_once(self) -> None:
        if not self.metered:
            self.metered = True
            await self._unmetered()


class EventStreamResponse(Response):
    """The client's side: the stream's head, then every event the pump queues, as it comes. (A
    `Response` so that FastAPI's router, which serves the contract when tracing is on, passes it on.)"""

    def __init__(self, relay: StreamRelay) -> None:
        super().__init__(status_code=200)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = self.relay
        gone = asyncio.ensure_future(_disconnected(receive))
        gone.add_done_callback(self._left)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            while True:
                item = await relay.queue.get()
                if item is None or relay.detached:
                    break
                await send({"type": "http.response.body", "body": item, "more_body": True})
            if not relay.detached:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            relay.detach()  # whatever ended the answer, the pump never waits for this reader again

    def _left(self, gone: asyncio.Future[None]) -> None:
        if gone.cancelled():
            return  # the answer ended first
        self.relay.detach()
        self.relay.queue.put_nowait(None)  # wake the response loop (the queue was just emptied)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


__all__ = ["AgentEvents", "EventStreamResponse", "MalformedStream", "StreamRelay", "cancel_on_disconnect",
           "error_event", "wants_stream"]
