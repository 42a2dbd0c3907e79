"""Pure arithmetic of ceilings and deadlines (no I/O, unit-tested on its own).

Operator settings are ceilings; a workspace's values (handed over by the edge, per
the catalogue in `contract/limits.py`) lower them further; a request hint may
only lower what is left. Hints above a ceiling are clamped, never refused, and
the values in force are reported back.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sandpool.contract import limits as catalogue
from sandpool.state.sessions import SessionLimits


class WorkspacePolicy(dict[str, int]):
    """A workspace's own numeric limits as the edge handed them over, by catalogue name (0 = none of its own)."""


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
    workspace: Mapping[str, int] = field(default_factory=dict)
    """The ceiling of every limit the session layer enforces, by catalogue name (0 = none)."""

    @classmethod
    def from_settings(cls, settings: Any) -> Ceilings:
        return cls(
            default_idle=settings.default_idle_timeout_seconds, max_idle=settings.max_idle_timeout_seconds,
            default_lifetime=settings.default_lifetime_seconds, max_lifetime=settings.max_lifetime_seconds,
            default_exec=settings.default_exec_timeout_seconds, max_exec=settings.max_exec_timeout_seconds,
            workspace={limit.name: int(getattr(settings, limit.ceiling, 0) or 0)
                       for limit in catalogue.counts(catalogue.handed_over())},
        )


def in_force(ceilings: Ceilings, policy: Mapping[str, int]) -> dict[str, int]:
    """Every limit the session layer enforces, for one workspace: its value bounded by the ceiling."""
    return {name: catalogue.combine(int(policy.get(name, 0)), ceiling) for name, ceiling in ceilings.workspace.items()}


def lease_limits(ceilings: Ceilings, policy: Mapping[str, int]) -> dict[str, int]:
    """The numeric limits the lease script checks (every catalogue count `enforced_by` the lease; the
    egress allow-list goes to the lease on its own, as the list it is)."""
    forced = in_force(ceilings, policy)
    return {limit.name: forced.get(limit.name, 0) for limit in catalogue.counts(catalogue.handed_over())
            if limit.enforced_by == "lease"}


def lower(ceiling: int, workspace_max: int) -> int:
    """The operator's ceiling lowered by a workspace maximum (0 or less = none)."""
    return min(ceiling, workspace_max) if workspace_max > 0 else ceiling


def clamp(hint: int | None, default: int, ceiling: int) -> int:
    """A hint (or the default when absent) clamped into [1, ceiling]."""
    value = default if hint is None else hint
    return max(1, min(value, ceiling))


def session_limits(ceilings: Ceilings, policy: Mapping[str, int], *, idle_hint: int | None,
                   lifetime_hint: int | None) -> SessionLimits:
    max_idle = lower(ceilings.max_idle, policy.get("max_idle_timeout_seconds", 0))
    max_lifetime = lower(ceilings.max_lifetime, policy.get("max_lifetime_seconds", 0))
    max_exec = lower(ceilings.max_exec, policy.get("max_exec_timeout_seconds", 0))
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


def reap_reason(*, now: float, created_at: float, lifetime: float, idle: float) -> str:
    """Why an expired session is reaped: its max lifetime; due before its idle timeout could have passed,
    only the answer's grace (its CreateSession's answer was never confirmed sent); else idleness."""
    if now >= created_at + lifetime:
        return "lifetime"
    return "unanswered" if now < created_at + idle else "idle"


def seconds_until_utc_midnight(now: float) -> int:
    """Retry-After for an exhausted daily budget: the budget renews at 00:00 UTC."""
    return max(1, int(86400 - (now % 86400)) + 1)
