"""The contract's tool-kind registry: one request model per kind, and everything else derives from it."""

from __future__ import annotations

from typing import Literal

import pytest

from sandpool.contract.models import (
    TOOL_KINDS,
    TOOL_REQUESTS,
    BashExecutionRequest,
    CodeExecutionRequest,
    ExecRequest,
    TextEditorRequest,
    ToolInput,
    register_tool_kind,
)


def test_the_built_in_kinds_are_registered_in_wire_order() -> None:
    assert list(TOOL_KINDS) == ["code_execution", "bash_code_execution", "text_editor_code_execution"]
    assert list(TOOL_REQUESTS.values()) == [CodeExecutionRequest, BashExecutionRequest, TextEditorRequest]


def test_a_kind_cannot_be_registered_twice() -> None:
    class Again(ExecRequest):
        tool: Literal["code_execution"]
        input: ToolInput

    with pytest.raises(ValueError, match="already registered"):
        register_tool_kind(Again)
    assert TOOL_REQUESTS["code_execution"] is CodeExecutionRequest


@pytest.mark.parametrize("annotation", [str, Literal["a", "b"], Literal[1]])
def test_a_request_model_must_name_exactly_one_kind(annotation: object) -> None:
    vague = type("Vague", (ExecRequest,), {"__annotations__": {"tool": annotation, "input": ToolInput}})
    with pytest.raises(TypeError, match="Literal"):
        register_tool_kind(vague)
    assert list(TOOL_KINDS) == ["code_execution", "bash_code_execution", "text_editor_code_execution"]


def test_the_registry_is_read_only_from_outside() -> None:
    with pytest.raises(TypeError):
        TOOL_REQUESTS["x"] = CodeExecutionRequest  # type: ignore[index]
