"""`core.fds.until_ready`: one wait on a raw fd in the event loop, and nothing left registered after it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import pytest

from sandpool.core.fds import until_ready


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    yield read_end, write_end
    os.close(read_end)
    os.close(write_end)


async def test_a_pipe_that_speaks_wakes_the_reader_and_leaves_no_callback(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    waiting = asyncio.ensure_future(until_ready(read_end))
    await asyncio.sleep(0.05)
    assert not waiting.done(), "woke before anything was written"
    os.write(write_end, b"ok")
    await asyncio.wait_for(waiting, 5)
    assert os.read(read_end, 16) == b"ok"
    assert not asyncio.get_running_loop().remove_reader(read_end), "the reader callback was left registered"


async def test_a_full_pipe_wakes_the_writer_once_drained(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    with pytest.raises(BlockingIOError):
        while True:
            os.write(write_end, b"x" * 65536)
    waiting = asyncio.ensure_future(until_ready(write_end, write=True))
    await asyncio.sleep(0.05)
    assert not waiting.done(), "woke while the pipe was full"
    with pytest.raises(BlockingIOError):
        while True:
            os.read(read_end, 1 << 20)
    await asyncio.wait_for(waiting, 5)
    assert not asyncio.get_running_loop().remove_writer(write_end), "the writer callback was left registered"


async def test_a_cancelled_wait_removes_its_callback(pipe: tuple[int, int]) -> None:
    read_end, _ = pipe
    waiting = asyncio.ensure_future(until_ready(read_end))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not asyncio.get_running_loop().remove_reader(read_end), "a cancelled wait left its callback"
