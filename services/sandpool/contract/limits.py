"""The catalogue of workspace limits: each one declared once, read by the proxy, the scheduler and the docs.

A limit is a field of a workspace's policy (set by an admin through the proxy)
that an operator's setting bounds (the ceiling, which is also what a workspace
without a policy gets). From this one declaration:

- the proxy builds its policy model and checks a stored value against the ceiling;
- limits the scheduler enforces travel from the proxy in an `X-Sandpool-*` header
  named after them; the scheduler refuses a request that lacks one (a forgotten
  header never means "no limit") and combines the value with its own ceiling;
- limits the lease enforces reach the lease script as one JSON argument (so adding
  one needs no new script argument), and are recorded on the session;
- `docs/api.md` and `docs/proxy.md` list them (a test keeps the list current).

Adding a limit is one entry here plus its enforcement where `enforced_by` says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from sandpool.contract.tenancy import HEADER_PREFIX

Enforcer = Literal["proxy", "scheduler", "lease"]


@dataclass(frozen=True)
class Limit:
    """One workspace limit. Values are non-negative integers; 0 means "none of its own"."""

    name: str
    description: str
    enforced_by: Enforcer
    """`proxy`: at the edge; `scheduler`: on each call; `lease`: inside the atomic lease script."""
    ceiling: str
    """The operator setting holding the ceiling (and the default): a scheduler setting, or the
    proxy's for limits the proxy enforces."""
    unit: str = ""

    @property
    def header(self) -> str | None:
        """The header carrying it from the proxy to the scheduler; None for the proxy's own."""
        if self.enforced_by == "proxy":
            return None
        return "X-Sandpool-" + "-".join(part.capitalize() for part in self.name.split("_"))

    @property
    def ceiling_owner(self) -> Literal["proxy", "scheduler"]:
        return "proxy" if self.enforced_by == "proxy" else "scheduler"


LIMITS: tuple[Limit, ...] = (
    Limit("max_concurrent_sessions", "Live sessions at once (waiters for a sandbox count)", "lease",
          ceiling="workspace_max_concurrent_sessions", unit="sessions"),
    Limit("max_idle_timeout_seconds", "Ceiling of a session's idle timeout", "scheduler",
          ceiling="max_idle_timeout_seconds", unit="s"),
    Limit("max_lifetime_seconds", "Ceiling of a session's lifetime", "scheduler",
          ceiling="max_lifetime_seconds", unit="s"),
    Limit("max_exec_timeout_seconds", "Ceiling of one execution's timeout", "scheduler",
          ceiling="max_exec_timeout_seconds", unit="s"),
    Limit("daily_session_seconds_budget", "Session-seconds per UTC day (live sessions count as they run)", "lease",
          ceiling="workspace_daily_session_seconds_budget", unit="s"),
    Limit("requests_per_minute", "Requests per UTC minute, across all proxy replicas", "proxy",
          ceiling="ceiling_requests_per_minute", unit="requests"),
)
"""Every limit, in the order the docs list them."""

MAX_VALUE = 10**12


def forwarded(limits: Iterable[Limit] | None = None) -> tuple[Limit, ...]:
    """The limits the proxy sends to the scheduler (each in its header)."""
    return tuple(limit for limit in (LIMITS if limits is None else limits) if limit.header is not None)


def by_name() -> dict[str, Limit]:
    return {limit.name: limit for limit in LIMITS}


def combine(value: int, ceiling: int) -> int:
    """A workspace's value bounded by the operator's ceiling (0 on either side: that side sets none)."""
    if value > 0 and ceiling > 0:
        return min(value, ceiling)
    return value or ceiling


def combine_all(values: Mapping[str, int], ceilings: Mapping[str, int]) -> dict[str, int]:
    """Every limit in force: stored values (missing: none) bounded by the ceilings (missing: none)."""
    return {limit.name: combine(int(values.get(limit.name) or 0), int(ceilings.get(limit.name) or 0))
            for limit in LIMITS}
