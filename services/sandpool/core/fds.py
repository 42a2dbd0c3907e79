"""Waiting on a raw file descriptor in the event loop: a pipe, a socketpair, a child's stdin.

A reader or writer callback wakes one waiting coroutine, so a write that would block, or a
pipe that has not spoken yet, costs no thread and no poll.
"""

from __future__ import annotations

import asyncio


def _wake(waiter: asyncio.Future[None]) -> None:
    # The loop calls this again on every turn the fd stays ready, until the callback is removed.
    if not waiter.done():
        waiter.set_result(None)


async def until_ready(fd: int, *, write: bool = False) -> None:
    """Return once `fd` is readable (or writable, with `write`); cancellable, and bounded by the
    caller's own timeout."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    if write:
        loop.add_writer(fd, _wake, waiter)
    else:
        loop.add_reader(fd, _wake, waiter)
    try:
        await waiter
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)
