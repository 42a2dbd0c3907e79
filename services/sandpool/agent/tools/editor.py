"""`text_editor_code_execution`: view and edit workspace files (`agent.editor`), on a thread.

Not streamed (it answers one body), not timed (an edit is bounded by the read cap),
and it lists no produced files (the path it wrote is the one it was given)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool

from sandpool.agent.capture import StreamCapture
from sandpool.agent.execution import ExecOutcome, OutputListener
from sandpool.agent.tools.base import Tool
from sandpool.contract.models import TEXT_EDITOR_CODE_EXECUTION, TextEditorInput

if TYPE_CHECKING:
    from sandpool.agent.runtime import Runtime


async def run(runtime: Runtime, call: TextEditorInput, timeout: float,
              on_output: OutputListener | None) -> ExecOutcome:
    edit = await run_in_threadpool(runtime.editor.run, call)
    shown_out = StreamCapture(runtime.settings.max_output_bytes)  # a view is capped as any call's output
    shown_out.feed(edit.stdout.encode())
    return ExecOutcome(stdout=shown_out.text(), stderr=edit.stderr, return_code=edit.return_code,
                       output_truncated=shown_out.truncated)


TOOL = Tool[TextEditorInput](kind=TEXT_EDITOR_CODE_EXECUTION, run=run, streams=False, snapshots_files=False,
                             timed=False)
