"""The contract's tool-kind registry: one request model per kind, and everything else derives from it.

The built-in kinds' names are spelled once, in their request models; the rest of the service reads them
as `CODE_EXECUTION`, `BASH_CODE_EXECUTION` and `TEXT_EDITOR_CODE_EXECUTION`. The sources are read with
`ast`, so a second spelling (a client constant, a warm-up body) fails here wherever it is.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Literal

import pytest

from sandpool.contract.models import (
    BASH_CODE_EXECUTION,
    CODE_EXECUTION,
    TEXT_EDITOR_CODE_EXECUTION,
    TOOL_KINDS,
    TOOL_REQUESTS,
    BashExecutionRequest,
    CodeExecutionRequest,
    ExecRequest,
    TextEditorRequest,
    ToolInput,
    register_tool_kind,
)

SERVICES = Path(__file__).resolve().parents[2] / "services" / "sandpool"
SPELLED_IN = "contract/models.py"
BUILT_IN = {CODE_EXECUTION, BASH_CODE_EXECUTION, TEXT_EDITOR_CODE_EXECUTION}
# Still spelling a kind themselves, outside the change that brought the client and the agent's warm-up in:
# each agent tool module's `Tool(kind=...)`, and the local provider's zygote warm-up.


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


def test_the_named_kinds_are_the_registered_built_in_ones() -> None:
    assert [CODE_EXECUTION, BASH_CODE_EXECUTION, TEXT_EDITOR_CODE_EXECUTION] == list(TOOL_KINDS)[:3]


def spellings(source: str, where: str) -> list[str]:
    """Each string in `source` that is exactly a built-in kind's name (a mention inside a longer text, such
    as a docstring, is not a spelling of the vocabulary)."""
    return [f"{where}:{node.lineno} {node.value!r}" for node in ast.walk(ast.parse(source, where))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in BUILT_IN]


def test_the_built_in_kinds_are_spelled_only_in_the_contract() -> None:
    found = []
    for path in sorted(SERVICES.rglob("*.py")):
        where = path.relative_to(SERVICES).as_posix()
        if where != SPELLED_IN:
            found += spellings(path.read_text(), where)
    assert found == [], "name the built-in kinds with sandpool.contract's constants"


def test_a_second_spelling_is_found() -> None:
    planted = ('"""Runs code_execution calls."""\nTOOL_PYTHON = "code_execution"\n'
               'warm = {"tool": "text_editor_code_execution", "input": {}}\n')
    assert spellings(planted, "planted.py") == ["planted.py:2 'code_execution'",
                                                "planted.py:3 'text_editor_code_execution'"]
