"""`code_execution`: Python in the session's persistent interpreter."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandpool.agent.execution import ExecOutcome, OutputListener
from sandpool.agent.tools.base import Tool
from sandpool.contract.models import CODE_EXECUTION, CodeExecutionInput

if TYPE_CHECKING:
    from sandpool.agent.runtime import Runtime


async def run(runtime: Runtime, call: CodeExecutionInput, timeout: float,
              on_output: OutputListener | None) -> ExecOutcome:
    return await runtime.interpreter.run(call.code, timeout, on_output)


TOOL = Tool[CodeExecutionInput](kind=CODE_EXECUTION, run=run, restart_field="interpreter_restarted")
