"""Usage counters: their names, and how they read back.

The scheduler's scripts meter each figure as a total (`executions`,
`execution_seconds`) and, for executions, also per tool kind (`executions:<tool>`
in the hashes); a reader gets the totals plus a nested `by_tool` breakdown, the
shape a billing system takes as it is.
"""

from __future__ import annotations

from typing import Any

from sandpool.state.client import Client
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
    """A counters hash as figures: totals, with `field:tool` entries nested under `by_tool`."""
    out: dict[str, Any] = {}
    by_tool: dict[str, dict[str, int | float]] = {}
    for name, value in sorted(raw.items()):
        field, _, tool = name.partition(":")
        if tool and field in PER_TOOL:
            by_tool.setdefault(tool, {})[field] = _number(value)
        else:
            out[name] = _number(value)
    for field in PER_TOOL:
        out.setdefault(field, 0)
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
