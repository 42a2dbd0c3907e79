"""Moving bytes between a client and an origin: counted, bounded by idle time, half-closes passed on.

Each direction is a pump (read, write, drain, count). A connection ends when
both directions have reached end of file, when either fails, or when neither
has moved a byte for the idle timeout; one watchdog per connection checks that
(a timer per connection, not per read). The counts are what was written to
each side, which is what the workspace is metered for.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Iterable

CHUNK = 64 * 1024


class Activity:
    """When bytes last moved, in either direction."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def touch(self) -> None:
        self.last = time.monotonic()


class Tally:
    """Bytes written towards the origin (`out`) and towards the client (`in_`)."""

    def __init__(self) -> None:
        self.out = 0
        self.in_ = 0


class BodyError(Exception):
    """The client's request body broke its own framing."""


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
        await write(writer, data, activity)
        if towards_origin:
            tally.out += len(data)
        else:
            tally.in_ += len(data)
    if writer.can_write_eof() and not writer.is_closing():
        with contextlib.suppress(OSError, RuntimeError):
            writer.write_eof()


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
