"""A session's exec calls in arrival order, each with an id, so that a cancel names exactly one.

Calls take the session's lock first-in first-out (`asyncio.Lock`), exec and file calls
alike. An exec call waits for its turn under its id (the api's `Sandpool-Call-Id`, else
one of the agent's own); a cancel naming a call stops it if it runs, or withdraws it if
it still waits, so it never runs; no other call is touched. A cancel naming none stops
the running call (`DELETE /sessions/{id}/exec`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

CALL_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What an id a caller gives may look like (anything else: the agent names the call itself)."""


class Withdrawn(Exception):
    """The call was cancelled while it waited for its turn: it never ran."""


@dataclass
class _Ticket:
    call_id: str
    withdrawn: asyncio.Event = field(default_factory=asyncio.Event)
    running: bool = False


class CallQueue:
    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock = lock
        self._tickets: dict[str, _Ticket] = {}

    def name(self, given: str | None) -> str:
        """The id a new call goes by: the caller's when it is well formed and not in use, else a fresh one."""
        if given is not None and CALL_ID.fullmatch(given) and given not in self._tickets:
            return given
        return "agent-" + secrets.token_hex(8)

    @contextlib.asynccontextmanager
    async def turn(self, call_id: str) -> AsyncIterator[None]:
        """Hold the session's lock for the call `call_id`, after every call that came before it;
        `Withdrawn` if it was cancelled while it waited."""
        ticket = _Ticket(call_id)
        self._tickets[call_id] = ticket
        try:
            await self._acquire(ticket)
            ticket.running = True
            try:
                yield
            finally:
                ticket.running = False
                self.lock.release()
        finally:
            self._tickets.pop(call_id, None)

    async def _acquire(self, ticket: _Ticket) -> None:
        if not self.lock.locked() and not ticket.withdrawn.is_set():
            await self.lock.acquire()  # free: no waiting, nothing to withdraw from
            return
        acquiring = asyncio.ensure_future(self.lock.acquire())
        withdrawn = asyncio.ensure_future(ticket.withdrawn.wait())
        try:
            await asyncio.wait({acquiring, withdrawn}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            withdrawn.cancel()
            if not acquiring.done():
                acquiring.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await acquiring
        if acquiring.cancelled():
            raise Withdrawn(ticket.call_id)
        if ticket.withdrawn.is_set():  # its turn came as it was withdrawn: hand the turn on
            self.lock.release()
            raise Withdrawn(ticket.call_id)

    def running(self) -> str | None:
        """The id of the call holding the session now, if an exec call does."""
        return next((t.call_id for t in self._tickets.values() if t.running), None)

    def withdraw(self, call_id: str) -> bool:
        """Withdraw a call still waiting for its turn; False when it runs already or is unknown."""
        ticket = self._tickets.get(call_id)
        if ticket is None or ticket.running:
            return False
        ticket.withdrawn.set()
        return True
