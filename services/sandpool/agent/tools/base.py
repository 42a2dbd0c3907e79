"""What a tool kind is to the agent: its wire name, how it runs, and what its call reports."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sandpool.agent.execution import ExecOutcome, OutputListener

if TYPE_CHECKING:
    from sandpool.agent.runtime import Runtime

InputT = TypeVar("InputT")

RunTool = Callable[["Runtime", InputT, float, OutputListener | None], Awaitable[ExecOutcome]]
"""(runtime, the call's validated `input`, the timeout in force, the output listener) -> the outcome.
Runs under the session's lock; `on_output` is set only for a streamed call of a streaming tool."""


@dataclass(frozen=True)
class Tool(Generic[InputT]):
    """One tool kind the agent serves; `kind` must be a kind the contract registered (its request model)."""

    kind: str
    run: RunTool[InputT]
    streams: bool = True
    """A call asking for `text/event-stream` gets its output as events (otherwise its one JSON body)."""
    snapshots_files: bool = True
    """Files the call created or changed in the workspace are listed in the result (`content`)."""
    timed: bool = True
    """The call runs under the timeout, and the response reports it (`timeout_seconds`)."""
    restart_field: str | None = None
    """The response field set to true when the call lost (or started in a fresh) child, if any."""


AnyTool = Tool[Any]
