"""A usage hash reads back in one fixed shape: every counter and every built-in tool kind, 0 when absent.

A billing consumer reads the admin API's totals and days as they are; a counter that
appears only once it is non-zero (a first capacity refusal) breaks it. The names are
spelled out here rather than taken from `sandpool.state.usage`, so that renaming or
dropping one fails this test instead of silently changing the answer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sandpool.contract import TOOL_KINDS
from sandpool.state.usage import view

FLAT = ("sessions_created", "session_seconds", "executions", "execution_seconds", "bytes_uploaded",
        "bytes_downloaded", "capacity_refusals", "quota_refusals", "egress_bytes", "egress_bytes_in",
        "egress_bytes_out", "egress_connections", "unconfirmed_executions")
BUILT_IN_TOOLS = ("code_execution", "bash_code_execution", "text_editor_code_execution")
API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def zeros() -> dict[str, Any]:
    return {**{name: 0 for name in FLAT},
            "by_tool": {tool: {"executions": 0, "execution_seconds": 0} for tool in BUILT_IN_TOOLS}}


def test_the_built_in_tool_kinds_are_the_contracts() -> None:
    assert set(BUILT_IN_TOOLS) == set(TOOL_KINDS)


def test_an_empty_hash_reads_as_every_counter_at_zero() -> None:
    assert view({}) == zeros()


def test_a_partial_hash_reads_its_figures_and_zero_for_the_rest() -> None:
    raw = {"sessions_created": "3", "executions": "2", "execution_seconds": "1.25",
           "executions:bash_code_execution": "2", "execution_seconds:bash_code_execution": "1.25",
           "egress_bytes": "10", "capacity_refusals": "1"}
    expected = zeros()
    expected.update(sessions_created=3, executions=2, execution_seconds=1.25, egress_bytes=10, capacity_refusals=1)
    expected["by_tool"]["bash_code_execution"] = {"executions": 2, "execution_seconds": 1.25}
    assert view(raw) == expected


def test_what_this_reader_does_not_know_is_kept() -> None:
    # Executions metered under a kind since unregistered still count (both its figures there), and a
    # counter a newer writer added is passed on rather than lost.
    figures = view({"executions": "1", "executions:retired_tool": "1", "newer_counter": "5"})
    assert figures["by_tool"]["retired_tool"] == {"executions": 1, "execution_seconds": 0}
    assert set(figures["by_tool"]) == set(BUILT_IN_TOOLS) | {"retired_tool"}
    assert figures["newer_counter"] == 5 and set(figures) == set(zeros()) | {"newer_counter"}


def test_the_documented_answer_has_the_shape_view_gives() -> None:
    text = API_DOC.read_text()
    section = text[text.index("### `GET /v1/usage"):]
    start = section.index("```json") + len("```json")
    example = json.loads(section[start:section.index("```", start)])
    for counters in (example["total"], *(day["counters"] for day in example["days"])):
        assert list(counters) == list(view({})), "docs/api.md's usage example lists other counters than view"
        assert set(counters["by_tool"]) == set(BUILT_IN_TOOLS)
