"""The tool kinds this agent serves: one module per kind, registered here by kind.

The contract (`sandpool.contract.models`) declares each kind's request model; a
module here says how the agent runs it (`Tool`). `app.run_call` looks the call's
kind up and runs it; everything around the call (lock, produced files, restart
and limit fields, outcome label, the response) is the same for every kind.
docs/agent.md, "Adding a tool kind", lists the steps.
"""

from __future__ import annotations

from sandpool.agent.tools import bash, code, editor
from sandpool.agent.tools.base import AnyTool, RunTool, Tool
from sandpool.contract.models import TOOL_KINDS

_tools: dict[str, AnyTool] = {}


def register(tool: AnyTool) -> AnyTool:
    """Serve `tool`. Its kind must already be a contract kind (`register_tool_kind`), so the
    agent and the api parse its calls alike."""
    if tool.kind not in TOOL_KINDS:
        raise ValueError(f"tool kind {tool.kind!r} has no request model in the contract (register_tool_kind)")
    if tool.kind in _tools:
        raise ValueError(f"tool kind {tool.kind!r} is already served")
    _tools[tool.kind] = tool
    return tool


def unregister(kind: str) -> None:
    del _tools[kind]


def get(kind: str) -> AnyTool | None:
    """The tool serving `kind`, or None when this agent serves no such kind."""
    return _tools.get(kind)


for _module in (code, bash, editor):
    register(_module.TOOL)

__all__ = ["AnyTool", "RunTool", "Tool", "get", "register", "unregister"]
