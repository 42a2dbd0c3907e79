"""Callers waiting for a sandbox: woken by one notification channel, checked by one shared poll.

A CreateSession that finds no ready sandbox below the pool's ceiling is queued in
Redis (the lease script does it, in the same round trip); the pool controller
starts a sandbox for it and promises it to the next waiter in line. This
replica learns which of its waiters were promised one from the `promised`
channel; a message lost to a Redis reconnect is made up by one poll of all of
this replica's waiters together every `poll_seconds` (never a poll per waiter).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sandpool.state import channels
from sandpool.state.client import Client
from sandpool.state.errors import StateError
from sandpool.state.keys import Keys
from sandpool.state.sessions import SessionStore

log = logging.getLogger(__name__)


class Waiters:
    def __init__(self, client: Client, keys: Keys, store: SessionStore, *, poll_seconds: float = 0.5) -> None:
        self.client = client
        self.keys = keys
        self.store = store
        self.poll_seconds = poll_seconds
        self._events: dict[str, asyncio.Event] = {}
        self._running = True

    def __len__(self) -> int:
        return len(self._events)

    def register(self, waiter: str) -> asyncio.Event:
        """The event set when `waiter` may have a sandbox promised (then `claim` says whether it has)."""
        event = self._events.get(waiter)
        if event is None:
            event = self._events[waiter] = asyncio.Event()
        return event

    def forget(self, waiter: str) -> None:
        self._events.pop(waiter, None)

    def _wake(self, waiter: str) -> None:
        event = self._events.get(waiter)
        if event is not None:
            event.set()

    async def run(self) -> None:
        """Listen and poll until cancelled."""
        listener = asyncio.create_task(
            channels.listen(self.client, self.keys.promised, self._wake, while_=lambda: self._running),
            name="sandpool-waiters-listen")
        try:
            while True:
                await asyncio.sleep(self.poll_seconds)
                if not self._events:
                    continue
                try:
                    for waiter in await self.store.promised(list(self._events)):
                        self._wake(waiter)
                except StateError as exc:
                    log.debug("waiter poll failed", extra={"error": str(exc)})
        finally:
            self._running = False
            listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await listener
