"""Pure arithmetic of ceilings and deadlines (no I/O, unit-tested on its own).

Operator settings are ceilings; a workspace's injected maxima lower them
further; a request hint may only lower what is left. Hints above a ceiling are
clamped, never refused, and the values in force are reported back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkspacePolicy:
    """The workspace's own limits as the proxy injected them (0 = no limit of its own)."""

    max_concurrent_sessions: int = 0
    max_idle_timeout_seconds: int = 0
    max_lifetime_seconds: int = 0
    max_exec_timeout_seconds: int = 0
    daily_session_seconds_budget: int = 0


NO_POLICY = WorkspacePolicy()


@dataclass(frozen=True)
class Ceilings:
    """The operator's defaults and ceilings (from the settings)."""

    default_idle: int
    max_idle: int
    default_lifetime: int
    max_lifetime: int
    default_exec: int
    max_exec: int


@dataclass(frozen=True)
class SessionLimits:
    """What is in force for one session, reported on its handle."""

    idle_timeout_seconds: int
    max_lifetime_seconds: int
    exec_timeout_seconds: int
    max_exec_timeout_seconds: int


def lower(ceiling: int, workspace_max: int) -> int:
    """The operator's ceiling lowered by a workspace maximum (0 or less = none)."""
    return min(ceiling, workspace_max) if workspace_max > 0 else ceiling


def clamp(hint: int | None, default: int, ceiling: int) -> int:
    """A hint (or the default when absent) clamped into [1, ceiling]."""
    value = default if hint is None else hint
    return max(1, min(value, ceiling))


def session_limits(ceilings: Ceilings, policy: WorkspacePolicy, *, idle_hint: int | None,
                   lifetime_hint: int | None) -> SessionLimits:
    max_idle = lower(ceilings.max_idle, policy.max_idle_timeout_seconds)
    max_lifetime = lower(ceilings.max_lifetime, policy.max_lifetime_seconds)
    max_exec = lower(ceilings.max_exec, policy.max_exec_timeout_seconds)
    lifetime = clamp(lifetime_hint, ceilings.default_lifetime, max_lifetime)
    return SessionLimits(
        idle_timeout_seconds=clamp(idle_hint, ceilings.default_idle, max_idle),
        max_lifetime_seconds=lifetime,
        exec_timeout_seconds=clamp(None, ceilings.default_exec, max_exec),
        max_exec_timeout_seconds=max_exec,
    )


def exec_timeout(requested: object, *, default: int, ceiling: int, workspace_max: int = 0) -> int | None:
    """The exec timeout to run with, or None when `requested` is not an integer (the agent says 422).

    `default` and `ceiling` are the session's values in force; `workspace_max`
    is the workspace's maximum on this very call (the policy may have been
    lowered since the session was created).
    """
    ceiling = lower(ceiling, workspace_max)
    if requested is None:
        return min(default, ceiling)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        return None
    return min(requested, ceiling)


def deadline(*, now: float, created_at: float, idle: float, lifetime: float, busy_for: float = 0.0) -> float:
    """When a session must be reaped: idle after its last activity, never past its max lifetime.

    `busy_for` extends the idle deadline over a call in flight (an exec may run
    for its whole timeout without the session counting as idle).
    """
    return min(created_at + lifetime, now + busy_for + idle)


def reap_reason(*, now: float, created_at: float, lifetime: float) -> str:
    """Why an expired session is reaped: its max lifetime, or idleness."""
    return "lifetime" if now >= created_at + lifetime else "idle"


def seconds_until_utc_midnight(now: float) -> int:
    """Retry-After for an exhausted daily budget: the budget renews at 00:00 UTC."""
    return max(1, int(86400 - (now % 86400)) + 1)


def utc_day(now: float) -> str:
    """The UTC day (`YYYY-MM-DD`) a usage figure at `now` counts towards."""
    return time.strftime("%Y-%m-%d", time.gmtime(now))
