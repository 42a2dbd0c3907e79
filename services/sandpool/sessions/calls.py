"""One call to a session's agent, from the round trip that recorded it to its one end.

The round trip that admits a call (the edge's `admit_call`, or the standalone
touch) also writes the call's record in Redis. A `Call` ends exactly once:
`finish` meters it, marks the session active and removes the record in one
script (`done`), which itself does nothing for a record already gone, so a
`finish` that raced another, or came after the controller settled an overdue
record, counts nothing twice. The answer never waits for it: a relayed answer
finishes its call in the response's background task, after the last byte is
sent, in the request's own task. A call whose api dies before its `finish` is
settled by the controller once the record's deadline passes.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

from starlette.background import BackgroundTask

from sandpool.sessions.caller import Caller
from sandpool.sessions.metrics import ApiMetrics
from sandpool.state.errors import StateUnavailable
from sandpool.state.sessions import CallSpec, SessionStore

log = logging.getLogger(__name__)


def new_call_id() -> str:
    """A call's id: its record's name and what a cancel of it names (unguessable; it never leaves the api)."""
    return secrets.token_urlsafe(12)


@dataclass(frozen=True)
class Metered:
    """What a finished call adds to the workspace's usage: an event and its amounts."""

    event: str
    amounts: dict[str, int | float]
    tool: str = ""


NOTHING = Metered("", {})


@dataclass
class Call:
    """An admitted call to `session_id`, recorded as `spec`; `finish` it once."""

    store: SessionStore
    metrics: ApiMetrics
    caller: Caller
    session_id: str
    spec: CallSpec
    metered: Metered = NOTHING
    """What `finish_in_background` meters: set once the answer is known."""
    ended: bool = field(default=False, init=False)

    @property
    def call_id(self) -> str:
        return self.spec.call_id

    async def finish(self, metered: Metered | None = None) -> None:
        """Meter the call (or not: `NOTHING`), mark the session active and remove its record; the first
        `finish` counts, any later one is a no-op.

        The call already ran in the sandbox, so a Redis failure here must not turn its answer into an
        error the client would retry (running the code twice): it is logged and counted, and the
        record stays for the controller to settle as an unconfirmed call."""
        if self.ended:
            return
        self.ended = True
        metered = self.metered if metered is None else metered
        try:
            await self.store.done(call_id=self.call_id, session_id=self.session_id, workspace=self.caller.workspace,
                                  now=time.time(), event=metered.event, tool=metered.tool, amounts=metered.amounts)
        except StateUnavailable as exc:
            self.metrics.redis_error()
            log.error("a finished call's done not recorded; the controller settles it", extra={
                "session": self.session_id, "workspace": self.caller.workspace, "event": metered.event,
                "amounts": metered.amounts, "error": type(exc).__name__})

    def in_background(self) -> BackgroundTask:
        """`finish` as a response's background task: it runs after the answer is sent, in the request's task."""
        return BackgroundTask(self.finish)


__all__ = ["NOTHING", "Call", "Metered", "new_call_id"]
