"""`core.fds.until_ready`: one wait on a raw fd in the event loop, and nothing left registered after it."""

from __future__ import annotations

import asyncio
import os

import pytest

from sandpool.core.fds import until_ready


async def test_a_pipe_that_speaks_wakes_the_reader_and_leaves_no_callback() -> None:
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(read_end, False)
        waiting = asyncio.ensure_future(until_ready(read_end))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "woke before anything was written"
        os.write(write_end, b"ok")
        await asyncio.wait_for(waiting, 5)
        assert os.read(read_end, 16) == b"ok"
        assert not asyncio.get_running_loop().remove_reader(read_end), "the reader callback was left registered"
    finally:
        os.close(read_end)
        os.close(write_end)


async def test_a_full_pipe_wakes_the_writer_once_drained() -> None:
    read_end, write_end = os.pipe()
    try:
        os.set_blocking(write_end, False)
        with pytest.raises(BlockingIOError):
            while True:
                os.write(write_end, b"x" * 65536)
        waiting = asyncio.ensure_future(until_ready(write_end, write=True))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "woke while the pipe was full"
        os.set_blocking(read_end, False)
        with pytest.raises(BlockingIOError):
            while True:
                os.read(read_end, 1 << 20)
        await asyncio.wait_for(waiting, 5)
        assert not asyncio.get_running_loop().remove_writer(write_end), "the writer callback was left registered"
    finally:
        os.close(read_end)
        os.close(write_end)


async def test_a_cancelled_wait_removes_its_callback() -> None:
    read_end, write_end = os.pipe()
    try:
        waiting = asyncio.ensure_future(until_ready(read_end))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not asyncio.get_running_loop().remove_reader(read_end), "a cancelled wait left its callback"
    finally:
        os.close(read_end)
        os.close(write_end)
