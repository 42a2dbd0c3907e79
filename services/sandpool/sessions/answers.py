"""Telling Redis that a CreateSession was answered, so the session keeps its idle timeout.

A lease makes its session due a short grace after it (`answer_grace_seconds`), not at its idle
timeout: an api killed between the lease and the answer would otherwise leave a sandbox leased, for
an idle timeout, to a session nobody was told of. Once the answer is sent (the response's
background task, in the request's own task) the session is confirmed. Confirmations group: the
answers sent while one round trip is on its way go together in the next (whichever of their tasks
gets there first sends them all; the others find theirs sent), so under load a round trip carries
many sessions, at rest each answer costs one, and while Redis answers no task waits for more than
two. The confirmation is acknowledged by a replica as the lease was (`state.client.acknowledged`):
a failover keeps both or neither. `answer_grace_seconds` = 0 turns all of this off (a lease is due
at its idle timeout, nothing is confirmed).
"""

from __future__ import annotations

import asyncio
import logging
import time

from sandpool.state import StateUnavailable
from sandpool.state.errors import StateError
from sandpool.state.sessions import SessionStore

log = logging.getLogger(__name__)

RETRY_PAUSE_SECONDS = 0.2
ANSWERED_CHUNK = 200
"""Sessions one confirmation carries at most (about 3 commands each): after a stall the backlog goes in
calls that each hold Redis well under a millisecond."""


class Answers:
    def __init__(self, store: SessionStore, grace_seconds: float) -> None:
        self.store = store
        self.grace_seconds = grace_seconds
        self._waiting: dict[str, None] = {}  # answered, not yet sent: in order, each once
        self._sending = asyncio.Lock()

    async def answered(self, session_id: str) -> None:
        """Confirm `session_id` (with whatever else was answered meanwhile). While Redis is unreachable
        it is retried for the grace (confirming is idempotent, and a session the reaper released
        meanwhile is left alone); past that the session is released at its grace."""
        self._waiting[session_id] = None
        async with self._sending:
            if session_id not in self._waiting:
                return  # the round trip before this one took it
            batch = list(self._waiting)
            self._waiting.clear()
            try:
                await self._send(batch)
            except BaseException:
                # Cancelled (or a bug): the others' ids go back for whoever sends next.
                self._waiting.update(dict.fromkeys(batch))
                raise

    async def _send(self, batch: list[str]) -> None:
        give_up_at = time.monotonic() + self.grace_seconds
        pause = RETRY_PAUSE_SECONDS
        while batch:
            try:
                await self.store.answered(batch[:ANSWERED_CHUNK])
                del batch[:ANSWERED_CHUNK]
                continue
            except StateError as exc:  # (a refused script is not retried; an unreachable Redis is)
                if not isinstance(exc, StateUnavailable) or time.monotonic() + pause >= give_up_at:
                    log.warning("answered sessions could not be confirmed: they are released at their grace",
                                extra={"count": len(batch), "error": type(exc).__name__})
                    batch.clear()
                    return
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)
