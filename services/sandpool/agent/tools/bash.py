"""`bash_code_execution`: a command in the session's persistent bash."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandpool.agent.execution import ExecOutcome, OutputListener
from sandpool.agent.tools.base import Tool
from sandpool.contract.models import BASH_CODE_EXECUTION, BashExecutionInput

if TYPE_CHECKING:
    from sandpool.agent.runtime import Runtime


async def run(runtime: Runtime, call: BashExecutionInput, timeout: float,
              on_output: OutputListener | None) -> ExecOutcome:
    if "\x00" in call.command:  # bash reads its commands as C strings: a NUL would cut it silently
        return ExecOutcome(stdout="", stderr="command contains a NUL byte, which bash cannot take\n", return_code=2)
    return await runtime.shell.run(call.command, timeout, on_output)


TOOL = Tool[BashExecutionInput](kind=BASH_CODE_EXECUTION, run=run, restart_field="shell_restarted")
