"""Helpers for the pool controller tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout: float = 30, what: str = "") -> None:
    """Poll until `check()` is true; fail with `what` at the deadline (no fixed sleeps)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.05)
