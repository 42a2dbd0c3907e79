"""Telling Redis that a CreateSession was answered, so the session keeps its idle timeout.

A lease makes its session due a short grace after it (`answer_grace_seconds`), not at its idle
timeout: an api killed between the lease and the answer would otherwise leave a sandbox leased, for
an idle timeout, to a session nobody was told of. Once the answer is sent (the response's
background task) the session waits here to be confirmed; every `GATHER_SECONDS` one round trip
confirms all that wait (`state/lua/answered.lua`). A session called meanwhile needs none: the call's
own round trip already gave it its idle timeout, so under a client that calls what it creates the
confirmations cost nothing, and at rest they cost one round trip per quarter second at most.

The confirmation is acknowledged by a replica as the lease was (`state.client.acknowledged`), and
what waits is confirmed once more on the way out (`flush`). `answer_grace_seconds` = 0 turns all of
this off: a lease is due at its idle timeout and nothing is confirmed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from sandpool.state import StateUnavailable
from sandpool.state.errors import StateError
from sandpool.state.sessions import SessionStore

log = logging.getLogger(__name__)

GATHER_SECONDS = 0.25
"""How long answers gather before one round trip confirms them: far inside the grace, long enough that
a burst of CreateSessions shares one."""
ANSWERED_CHUNK = 200
"""Sessions one confirmation carries at most (about 3 commands each): after a stall the backlog goes in
calls that each hold Redis well under a millisecond."""
RETRY_PAUSE_SECONDS = 0.2


class Answers:
    def __init__(self, store: SessionStore, grace_seconds: float, *, gather_seconds: float = GATHER_SECONDS) -> None:
        self.store = store
        self.grace_seconds = grace_seconds
        self.gather_seconds = gather_seconds
        self._waiting: dict[str, None] = {}  # answered, not yet confirmed: in order, each once
        self._wake = asyncio.Event()

    async def answered(self, session_id: str) -> None:
        """The CreateSession of `session_id` was answered (a response's background task: no Redis here)."""
        self._waiting[session_id] = None
        self._wake.set()

    def called(self, session_id: str) -> None:
        """A call of `session_id` was admitted (or it was destroyed): its deadline is its idle timeout's
        already, so it needs no confirmation."""
        self._waiting.pop(session_id, None)

    async def stop(self, timeout: float = 5.0) -> None:
        """Confirm what still waits (bounded: a shutdown never hangs on an unreachable Redis)."""
        try:
            async with asyncio.timeout(timeout):
                await self.flush()
        except TimeoutError:
            log.warning("answered sessions left unconfirmed at stop: they are released at their grace",
                        extra={"count": len(self._waiting)})

    async def run(self) -> None:
        """Confirm what waits, a gathering at a time, until cancelled (then `stop` confirms the rest)."""
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.gather_seconds)
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # a bug here must not stop every later confirmation (what was not sent waits)
                log.exception("confirming answered sessions failed")
                self._wake.set()

    async def flush(self) -> None:
        """Confirm everything waiting now. While Redis is unreachable this is retried for the grace
        (confirming is idempotent, and leaves a session the reaper released meanwhile alone); past
        that, the sessions are released at their grace."""
        batch = list(self._waiting)
        self._waiting.clear()
        give_up_at = time.monotonic() + self.grace_seconds
        pause = RETRY_PAUSE_SECONDS
        try:
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
        finally:
            # Cancelled mid-way (the api stopping): what was not sent waits for the last flush.
            for session_id in batch:
                self._waiting.setdefault(session_id, None)
