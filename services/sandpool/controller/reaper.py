"""The session reaper: releases sessions whose deadline passed (idle or max lifetime), and settles
calls whose `done` never came (the api that ran them crashed).

(Not the agent's `ChildReaper`, which collects exited child processes.)

Every controller replica runs one (leader or not); it costs one index range
read per pass when nothing is due. The sessions due are read and released in the same script
(`reap.lua`, up to `REAP_CHUNK` per call, the release exactly release.lua's), so a pass with
1,000 due is a few round trips, not a thousand; replicas racing over the same session are
harmless (one of them releases it, the others find nothing due), and a session touched before
the script runs is no longer due.
A call's record past its deadline is metered as an unconfirmed call and removed,
and its session's deadline reset to its idle timeout from now; a `done` that
comes later finds no record and counts nothing twice.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

from sandpool.controller.metrics import ControllerMetrics
from sandpool.state.errors import StateUnavailable
from sandpool.state.sessions import SessionStore

log = logging.getLogger(__name__)

REAP_IN_FLIGHT = 2
"""Reap calls sent at once: the reaper handles one's replies while Redis runs the other."""
REAP_CHUNK = 32
"""Sessions one reap script releases at most: about 1.5 ms of Redis CPU (about 50 µs a release on the
2-CPU machine of docs/capacity.md), well under the 5 ms that no single call may hold Redis for."""


class SessionReaper:
    def __init__(self, store: SessionStore, metrics: ControllerMetrics, *, interval: float, batch: int) -> None:
        self.store = store
        self.metrics = metrics
        self.interval = interval
        self.batch = batch
        self.backlog = False  # the last pass settled a full batch of overdue calls: more may be due

    async def reap_once(self, now: float | None = None) -> int:
        """One pass; returns how many sessions it released."""
        now = time.time() if now is None else now
        settled, metered = await self.store.settle_overdue(now, self.batch)
        if settled:
            self.metrics.unconfirmed_calls.labels(kind="execution").inc(metered)
            self.metrics.unconfirmed_calls.labels(kind="file").inc(settled - metered)
            log.warning("calls settled without their done (their api crashed)",
                        extra={"calls": settled, "executions_metered": metered})
        self.backlog = settled >= self.batch
        released = examined = 0
        while examined < self.batch:
            # REAP_IN_FLIGHT calls at once, each of REAP_CHUNK: no one call holds Redis long, and the
            # replies are handled while Redis runs the next call. Each script takes what is due when it
            # runs (Redis runs them one after the other), so two never release the same session.
            asks = [n for n in (min(REAP_CHUNK, self.batch - examined - i * REAP_CHUNK)
                                for i in range(REAP_IN_FLIGHT)) if n > 0]
            answers = await asyncio.gather(*(self.store.reap(now, n) for n in asks))
            for due, reaped in answers:
                examined += due
                released += len(reaped)
                reasons = collections.Counter(result.reason for result in reaped)
                for result in reaped:
                    log.debug("session reaped", extra={"session": result.session_id, "why": result.reason,
                                                       "session_seconds": result.session_seconds})
                for reason, count in reasons.items():
                    self.metrics.reaped.labels(reason=reason).inc(count)
                if reaped:  # one line per call (each release is in the usage events, with its session)
                    log.info("sessions reaped", extra={"count": len(reaped), **reasons})
            if any(due < asked for asked, (due, _) in zip(asks, answers, strict=True)):
                break
        return released

    async def run(self, stop: asyncio.Event) -> None:
        """Reap until `stop` is set. (Stopping by event, not only by cancellation: a cancel
        that lands inside a Redis call can be absorbed by the client library.)"""
        down = False
        while not stop.is_set():
            try:
                # A full batch means more are due: go again at once rather than after a pause.
                if await self.reap_once() >= self.batch or self.backlog:
                    continue
                if down:
                    log.info("session reaper reaches redis again")
                    down = False
            except asyncio.CancelledError:
                raise
            except StateUnavailable as exc:
                self.metrics.redis_error()
                if not down:  # once per outage, not once per pass
                    log.warning("session reaper cannot reach redis", extra={"error": type(exc).__name__})
                    down = True
            except Exception:
                log.exception("session reaper pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
