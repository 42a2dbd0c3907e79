"""Usage counters: their names, and how they read back.

The session layer's scripts meter each figure as a total (`executions`,
`execution_seconds`) and, for executions, also per tool kind (`executions:<tool>`
in the hashes); a reader gets the totals plus a nested `by_tool` breakdown, the
shape a billing system takes as it is.

The hashes hold only what happened (a counter appears with its first increment), so
`view` fills in the rest: every one of `COUNTERS`, and both figures of every tool kind
the contract registers, read 0 until metered, so the answer's shape never depends
on what happened.
"""

from __future__ import annotations

from typing import Any

from sandpool.contract import TOOL_KINDS
from sandpool.state.client import Client
from sandpool.state.egress import EGRESS_BYTES, EGRESS_BYTES_IN, EGRESS_BYTES_OUT, EGRESS_CONNECTIONS
from sandpool.state.errors import translated
from sandpool.state.keys import Keys

SESSIONS_CREATED = "sessions_created"
SESSION_SECONDS = "session_seconds"
EXECUTIONS = "executions"
EXECUTION_SECONDS = "execution_seconds"
BYTES_UPLOADED = "bytes_uploaded"
BYTES_DOWNLOADED = "bytes_downloaded"
CAPACITY_REFUSALS = "capacity_refusals"
QUOTA_REFUSALS = "quota_refusals"
UNCONFIRMED_EXECUTIONS = "unconfirmed_executions"

COUNTERS = (SESSIONS_CREATED, SESSION_SECONDS, EXECUTIONS, EXECUTION_SECONDS, BYTES_UPLOADED, BYTES_DOWNLOADED,
            CAPACITY_REFUSALS, QUOTA_REFUSALS, EGRESS_BYTES, EGRESS_BYTES_IN, EGRESS_BYTES_OUT, EGRESS_CONNECTIONS,
            UNCONFIRMED_EXECUTIONS)
"""Every counter a usage answer has, in its order (`by_tool` follows `execution_seconds`); absent reads 0.
`unconfirmed_executions` is read before anything writes it, so the shape does not change when it is."""

PER_TOOL = (EXECUTIONS, EXECUTION_SECONDS)
"""Counters also kept per tool kind."""


def per_tool(field: str, tool: str) -> str:
    """The hash field of one tool's share of a counter (`executions:code_execution`)."""
    return f"{field}:{tool}"


def _number(value: str) -> int | float:
    try:
        return int(value)
    except ValueError:
        try:
            return round(float(value), 6)
        except ValueError:
            return 0


def view(raw: dict[str, str]) -> dict[str, Any]:
    """A counters hash as figures in one fixed shape: every counter, with `field:tool` entries nested under
    `by_tool` (every registered tool kind, and any other kind the hash names), 0 where nothing was metered.

    A field this reader does not know (a counter a newer writer added) is passed on rather than lost."""
    figures: dict[str, int | float] = {name: 0 for name in COUNTERS}
    by_tool: dict[str, dict[str, int | float]] = {tool: dict.fromkeys(PER_TOOL, 0) for tool in TOOL_KINDS}
    for name, value in sorted(raw.items()):
        field, _, tool = name.partition(":")
        if tool and field in PER_TOOL:
            by_tool.setdefault(tool, dict.fromkeys(PER_TOOL, 0))[field] = _number(value)
        else:
            figures[name] = _number(value)
    out: dict[str, Any] = {}
    for name, figure in figures.items():
        out[name] = figure
        if name == EXECUTION_SECONDS:
            out["by_tool"] = by_tool
    return out


class UsageStore:
    def __init__(self, client: Client, keys: Keys) -> None:
        self.redis = client
        self.keys = keys

    @translated
    async def read(self, workspace: str, days: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Totals, and the counters of each of `days` (absent days read as empty)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.usage_total(workspace))
            for day in days:
                pipe.hgetall(self.keys.usage_day(workspace, day))
            results = await pipe.execute()
        per_day = [{"day": day, "counters": view(raw)} for day, raw in zip(days, results[1:], strict=True)]
        return view(results[0]), per_day
