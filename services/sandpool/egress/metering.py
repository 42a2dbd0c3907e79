"""Writing each connection's bytes to the workspace's usage when the connection ends.

One `EgressStore.meter` call per connection (counters and an `egress` event in
one script), with the proxy's own clock. It runs as a task of its own, so a
connection cut by a shutdown is still metered, and it retries a Redis outage
for a bounded time; `drain` waits for what is in flight before the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from sandpool.egress.metrics import EgressMetrics
from sandpool.state.egress import EgressStore
from sandpool.state.errors import StateError, StateUnavailable

log = logging.getLogger(__name__)

RETRY_DELAYS = (0.2, 1.0, 3.0, 10.0)


@dataclass(frozen=True)
class Usage:
    workspace: str
    session: str
    host: str
    port: int
    bytes_in: int
    bytes_out: int
    ended_at: float


class Meter:
    def __init__(self, store: EgressStore, metrics: EgressMetrics) -> None:
        self.store = store
        self.metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()

    def record(self, usage: Usage) -> None:
        """Meter `usage` in the background (nothing to meter when no byte moved)."""
        if not usage.bytes_in and not usage.bytes_out:
            return
        task = asyncio.get_running_loop().create_task(self._write(usage))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, usage: Usage) -> None:
        for attempt, delay in enumerate((0.0, *RETRY_DELAYS)):
            if delay:
                await asyncio.sleep(delay)
            try:
                await self.store.meter(workspace=usage.workspace, session=usage.session, bytes_in=usage.bytes_in,
                                       bytes_out=usage.bytes_out, now=usage.ended_at, host=usage.host,
                                       port=usage.port)
                return
            except StateUnavailable as exc:
                self.metrics.redis_error()
                log.warning("metering egress failed, will retry", extra={"attempt": attempt + 1, "error": str(exc)})
            except StateError as exc:
                self.metrics.redis_error()
                log.error("metering egress failed", extra={"error": str(exc)})
                break
        self.metrics.meter_failures.inc()
        log.error("egress bytes not metered", extra={"workspace": usage.workspace, "session": usage.session,
                                                      "bytes_in": usage.bytes_in, "bytes_out": usage.bytes_out})

    async def drain(self, timeout: float) -> None:
        """Wait (at most `timeout`) for every metering write in flight."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)


def now() -> float:
    return time.time()
