"""Moving bytes between a client and an origin: counted, bounded by idle time, half-closes passed on.

Each direction is a pump (read, write, drain, count). A connection ends when
both directions have reached end of file, when either fails, or when neither
has moved a byte for the idle timeout; one watchdog per connection checks that
(a timer per connection, not per read). The counts are the bytes that crossed
to the outside (written to the origin, read from it), which is what the
workspace is metered for.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable

CHUNK = 64 * 1024


class Activity:
    """When bytes last moved, in either direction."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()


class Tally:
    """The bytes that crossed to the outside: sent to the origin (`out`), received from it (`in_`)."""

    def __init__(self) -> None:
        self.out = 0
        self.in_ = 0
        self.answered = False  # a plain-HTTP response has started towards the client


class BodyError(Exception):
    """A request body broke its own framing, or a response head could not be read."""


async def write(writer: asyncio.StreamWriter, data: bytes, activity: Activity) -> None:
    writer.write(data)
    await writer.drain()
    activity.touch()


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, activity: Activity,
               tally: Tally, towards_origin: bool) -> None:
    """Copy until end of file, then half-close the other side (when it can be)."""
    while True:
        data = await reader.read(CHUNK)
        if not data:
            break
        activity.touch()
        if not towards_origin:
            tally.in_ += len(data)
        await write(writer, data, activity)
        if towards_origin:
            tally.out += len(data)
    if writer.can_write_eof() and not writer.is_closing():
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()


async def relay_response(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, activity: Activity,
                         tally: Tally, rewrite: Callable[[bytes], tuple[int, bytes]]) -> None:
    """An origin's answer to a plain-HTTP request: each head rewritten by `rewrite` (which returns the
    status and the head to send), interim (1xx) heads included, then the rest as it comes."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            raise BodyError("the origin's response head could not be read") from None
        activity.touch()
        tally.in_ += len(head)
        try:
            status, sent = rewrite(head)
        except ValueError as exc:
            raise BodyError(f"the origin's response head is malformed ({exc})") from None
        tally.answered = True
        await write(writer, sent, activity)
        if not 100 <= status < 200 or status == 101:
            break
    await pump(reader, writer, activity, tally, towards_origin=False)


async def copy_exactly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int,
                       activity: Activity, tally: Tally) -> None:
    left = n
    while left:
        data = await reader.read(min(CHUNK, left))
        if not data:
            raise BodyError("the request body ended early")
        left -= len(data)
        activity.touch()
        await write(writer, data, activity)
        tally.out += len(data)


async def copy_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, activity: Activity,
                       tally: Tally) -> None:
    """Relay one chunked body exactly (sizes, data, trailers) and not a byte beyond it."""

    async def line() -> bytes:
        try:
            data = await reader.readuntil(b"\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            raise BodyError("malformed chunked body") from None
        activity.touch()
        return data

    while True:
        size_line = await line()
        text = size_line[:-2].split(b";", 1)[0].strip()
        try:
            size = int(text, 16) if text and len(text) <= 15 and all(c in b"0123456789abcdefABCDEF" for c in text) \
                else -1
        except ValueError:
            size = -1
        if size < 0:
            raise BodyError("malformed chunk size")
        await write(writer, size_line, activity)
        tally.out += len(size_line)
        if size == 0:
            while True:
                trailer = await line()
                await write(writer, trailer, activity)
                tally.out += len(trailer)
                if trailer == b"\r\n":
                    return
        await copy_exactly(reader, writer, size, activity, tally)
        try:
            end = await reader.readexactly(2)
        except asyncio.IncompleteReadError:
            raise BodyError("the request body ended early") from None
        if end != b"\r\n":
            raise BodyError("malformed chunked body")
        await write(writer, end, activity)
        tally.out += 2


async def supervise(jobs: Iterable[Awaitable[None]], activity: Activity, idle_timeout: float, *,
                    ends_all: Awaitable[None] | None = None) -> str:
    """Run `jobs` (and `ends_all`, whose end cancels the rest) until all end, one fails, or nothing has
    moved for `idle_timeout`; the outcome: "done", "idle" or "failed"."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    final = asyncio.ensure_future(ends_all) if ends_all is not None else None
    pending: set[asyncio.Future[None]] = set(tasks) | ({final} if final else set())
    tick = min(max(idle_timeout / 4, 0.05), 5.0)
    outcome = "done"
    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=tick, return_when=asyncio.FIRST_COMPLETED)
            failures = [t for t in done if not t.cancelled() and t.exception() is not None]
            if failures:
                outcome = "failed"
                break
            if final is not None and final in done:
                break
            if pending and time.monotonic() - activity.last >= idle_timeout:
                outcome = "idle"
                break
    finally:
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    return outcome


LINGER_SECONDS = 1.0
LINGER_BYTES = 256 * 1024


async def linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """After an answer the client's request was not read to its end: close our side for writing and read
    what is still coming (bounded), so closing does not reset the connection before the client has
    read the answer."""
    if writer.can_write_eof():
        writer.write_eof()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_SECONDS
    drained = 0
    with contextlib.suppress(asyncio.TimeoutError, OSError, asyncio.LimitOverrunError):
        while drained < LINGER_BYTES:
            data = await asyncio.wait_for(reader.read(65536), max(0.0, deadline - loop.time()))
            if not data:
                break
            drained += len(data)


async def close_quietly(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(Exception):
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 2)
