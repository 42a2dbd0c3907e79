"""The agent's session fence: a sandbox serves the first session it is called for, and no other.

A sandbox is leased to at most one session, ever; Redis's lease script makes that
so, and this is the second line of defence for when Redis forgets (DESIGN.md,
"Redis": a failover can lose a lease the old primary had acknowledged, and the
sandbox, back in its pool's ready list, can be leased again). The api names the
session in every call's path (`/sessions/{id}/...`): the first id an
authenticated call names is the one this agent serves; a call naming any other
is refused with 409 and `FENCED_HEADER`, and the sandbox ends. It does not wait
to be told: the fence kills every child at once (the first session's interpreter
and files are never shown to the second), answers every later call the same
way, fails `/healthz`, and the agent process exits, so that the provider reports
the sandbox lost and the controller replaces it (a dead agent is a dead sandbox:
it is never restarted). The api releases the refused session as `dead`.

The agent's own start-up self-test (`/sessions/warm-up/exec`) runs before the
fence is armed and claims nothing.
"""

from __future__ import annotations

import logging

log = logging.getLogger("sandpool.agent")

SESSION_PREFIX = "/sessions/"


def session_of(path: str) -> str | None:
    """The session id a request path names (`/sessions/{id}` or `/sessions/{id}/...`), else None."""
    if not path.startswith(SESSION_PREFIX):
        return None
    session = path[len(SESSION_PREFIX):].split("/", 1)[0]
    return session or None


class Fence:
    """Which session this agent serves. `admits(id)` claims the agent for the first id it is asked
    about and then admits that id alone; a refusal trips the fence for good (`tripped`), after which
    nothing is admitted. One event loop calls it: the check and the claim are one step."""

    def __init__(self) -> None:
        self.session: str | None = None
        self.tripped = False
        self.refused: str | None = None

    def admits(self, session: str) -> bool:
        if self.tripped:
            return False
        if self.session is None:
            self.session = session
            return True
        if session == self.session:
            return True
        self.tripped = True
        self.refused = session
        log.error("a call for a second session: this sandbox serves another session and ends now "
                  "(a lease lost in a Redis failover leased it twice)",
                  extra={"serving": self.session, "refused": session})
        return False


__all__ = ["SESSION_PREFIX", "Fence", "session_of"]
