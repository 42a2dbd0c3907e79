"""Stopping a service's background tasks at shutdown: bounded, and loud about what went wrong."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


async def finish(task: asyncio.Task[Any], grace: float = 5.0) -> None:
    """Cancel a background task and wait a bounded time for it (never hang a shutdown)."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=grace)
    if not done:
        log.warning("background task did not stop in time", extra={"task": task.get_name()})
    elif not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())
