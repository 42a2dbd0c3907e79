"""The catalogue of workspace limits: each one declared once, read by the edge, the session layer and the docs.

A limit is a field of a workspace's policy (set by an admin through the edge's
admin API) that an operator's setting bounds (the ceiling, which is also what a
workspace without a policy gets). From this one declaration:

- the edge builds its policy model and checks a stored value against the ceiling;
- limits the session layer enforces reach it with the caller, in process, every one
  of them present (0 when the workspace has none of its own: never a missing key a
  later lookup could read as "no limit"), combined there with its own ceilings;
- limits the lease enforces reach the lease script as one JSON argument (so adding
  one needs no new script argument), and are recorded on the session;
- `docs/api.md` and `docs/edge.md` list them (a test keeps the list current).

Most limits are counts (`kind="count"`: a non-negative integer, 0 for none of the
workspace's own, bounded by a numeric ceiling). One is a list (`kind="list"`):
`egress_allow`, the destinations a session may reach through the egress proxy,
empty by default (no egress). Its ceiling is the egress proxy's own (`sandpool egress --egress-allow-ceiling`, which
that proxy publishes to Redis): the admin API refuses a list outside it, and the
egress proxy checks both on every connection.

The egress proxy learns a workspace's limits from the lease: `egress_allow` is bound
with the sandbox's credential, and the lease's numeric limits are recorded on the
session, where the egress proxy reads `max_egress_connections` with the binding. That count
is the egress proxy's to enforce and its ceiling the egress proxy's setting
(`ceiling_of="egress"`, `sandpool egress --max-connections-per-workspace`, also the
default); the session layer, which has no such setting, passes it through unbounded.

Adding a limit is one entry here plus its enforcement where `enforced_by` says.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

Enforcer = Literal["proxy", "scheduler", "lease"]
Kind = Literal["count", "list"]
Owner = Literal["proxy", "scheduler", "egress"]


@dataclass(frozen=True)
class Limit:
    """One workspace limit. Counts are non-negative integers, 0 meaning "none of its own"; lists are
    lists of strings, empty meaning "none at all"."""

    name: str
    description: str
    enforced_by: Enforcer
    """`proxy`: at the edge; `scheduler`: by the session layer, on each call (the values keep the names
    of the retired processes); `lease`: inside the atomic lease script, or recorded by it for the egress
    proxy (the egress limits)."""
    ceiling: str
    """The operator setting holding the ceiling (and the default): an api setting (the session layer's,
    or the edge's for limits the edge enforces), the egress proxy's for the egress limits."""
    unit: str = ""
    kind: Kind = "count"
    ceiling_of: Owner | None = None
    """Whose setting `ceiling` is when it is not what `enforced_by` implies: `egress` for a count the
    lease records and the egress proxy enforces."""

    @property
    def is_list(self) -> bool:
        return self.kind == "list"

    @property
    def ceiling_owner(self) -> Owner:
        if self.ceiling_of is not None:
            return self.ceiling_of
        if self.is_list:
            return "egress"
        return "proxy" if self.enforced_by == "proxy" else "scheduler"


MAX_EGRESS_CONNECTIONS = "max_egress_connections"
"""The egress proxy's per-workspace connection cap, as the lease records it on the session (state/egress.py)."""

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
    Limit("requests_per_minute", "Requests per UTC minute, across all api replicas", "proxy",
          ceiling="ceiling_requests_per_minute", unit="requests"),
    Limit("egress_allow", "Destinations sessions may reach through the egress proxy (HOST[:PORT], port 443 by "
          "default; *.example.com for names below a domain); empty: no egress", "lease",
          ceiling="egress_allow_ceiling", unit="entries", kind="list"),
    Limit(MAX_EGRESS_CONNECTIONS, "Connections the workspace's sessions hold at once through an egress proxy replica "
          "(429 above); applies to sessions leased after it is set", "lease",
          ceiling="max_connections_per_workspace", unit="connections", ceiling_of="egress"),
)
"""Every limit, in the order the docs list them."""

MAX_VALUE = 10**12
MAX_LIST_ENTRIES = 64
"""Most entries a list limit holds (it is bound to every session the workspace leases)."""
MAX_LIST_ENTRY_LENGTH = 300


def counts(limits: Iterable[Limit] | None = None) -> tuple[Limit, ...]:
    """The numeric limits (every limit but the lists)."""
    return tuple(limit for limit in (LIMITS if limits is None else limits) if not limit.is_list)


def lists(limits: Iterable[Limit] | None = None) -> tuple[Limit, ...]:
    """The list-valued limits."""
    return tuple(limit for limit in (LIMITS if limits is None else limits) if limit.is_list)


def handed_over(limits: Iterable[Limit] | None = None) -> tuple[Limit, ...]:
    """The limits the edge hands the session layer with the caller (every one but the edge's own)."""
    return tuple(limit for limit in (LIMITS if limits is None else limits) if limit.enforced_by != "proxy")


def by_name() -> dict[str, Limit]:
    return {limit.name: limit for limit in LIMITS}


def combine(value: int, ceiling: int) -> int:
    """A workspace's value bounded by the operator's ceiling (0 on either side: that side sets none)."""
    if value > 0 and ceiling > 0:
        return min(value, ceiling)
    return value or ceiling


def combine_all(values: Mapping[str, int], ceilings: Mapping[str, int]) -> dict[str, int]:
    """Every numeric limit in force: stored values (missing: none) bounded by the ceilings (missing: none)."""
    return {limit.name: combine(int(values.get(limit.name) or 0), int(ceilings.get(limit.name) or 0))
            for limit in counts()}
