"""The contract models accept what contract v1 allows and refuse what it does not."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandpool.contract import (
    CodeExecutionResult,
    CreateSessionRequest,
    ExecResponse,
    FileEntry,
    FileList,
    FileListing,
    ResultBlock,
    SessionDetails,
    SessionHandle,
    TextEditorRequest,
    parse_exec_request,
    result_type_for,
)
from sandpool.contract.models import UnknownTool


def test_code_execution_request_parses_and_tolerates_unknown_fields() -> None:
    req = parse_exec_request({"tool": "code_execution", "input": {"code": "print(1)", "x": 1}, "future": True})
    assert req.tool == "code_execution"
    assert req.input.code == "print(1)"
    assert req.model_extra == {"future": True}


@pytest.mark.parametrize("tool", ["python", "code_execution_v2", ""])
def test_unknown_tool_kind_is_its_own_error(tool: str) -> None:
    with pytest.raises(UnknownTool) as info:
        parse_exec_request({"tool": tool, "input": {}})
    assert repr(tool) in str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"tool": "code_execution"},
        {"tool": "code_execution", "input": {}},
        {"tool": "code_execution", "input": {"code": ""}},
        {"tool": "bash_code_execution", "input": {"code": "ls"}},
        {"tool": "code_execution", "input": {"code": "1"}, "timeout_seconds": 0},
        {"tool": 7, "input": {"code": "1"}},
        [],
        "code_execution",
    ],
)
def test_malformed_exec_bodies_are_validation_errors(body: object) -> None:
    with pytest.raises(ValidationError):
        parse_exec_request(body)


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        ({"command": "view", "path": "a"}, True),
        ({"command": "view", "path": "a", "view_range": [1, 3]}, True),
        ({"command": "view", "path": "a", "view_range": [1]}, False),
        ({"command": "create", "path": "a"}, False),
        ({"command": "create", "path": "a", "file_text": ""}, True),
        ({"command": "str_replace", "path": "a", "old_str": "x"}, False),
        ({"command": "str_replace", "path": "a", "old_str": "x", "new_str": ""}, True),
        ({"command": "insert", "path": "a", "new_str": "x"}, False),
        ({"command": "insert", "path": "a", "insert_line": 0, "new_str": "x"}, True),
        ({"command": "undo_edit", "path": "a"}, True),
        ({"command": "delete", "path": "a"}, False),
        ({"command": "view", "path": ""}, False),
    ],
)
def test_text_editor_fields_are_validated_per_command(fields: dict[str, object], ok: bool) -> None:
    body = {"tool": "text_editor_code_execution", "input": fields}
    if ok:
        assert isinstance(parse_exec_request(body), TextEditorRequest)
    else:
        with pytest.raises(ValidationError):
            parse_exec_request(body)


def test_result_block_nests_one_result_object_with_a_file_list() -> None:
    response = ExecResponse(
        tool_use_id="srvtoolu_1",
        result_block=ResultBlock(
            type=result_type_for("code_execution"),
            tool_use_id="srvtoolu_1",
            content=CodeExecutionResult(stdout="1\n"),
        ),
    )
    wire = response.model_dump()
    assert wire["result_block"]["type"] == "code_execution_tool_result"
    assert isinstance(wire["result_block"]["content"], dict)
    assert wire["result_block"]["content"]["content"] == []
    assert wire["result_block"]["content"]["return_code"] == 0


def test_empty_result_defaults_match_the_contract() -> None:
    result = CodeExecutionResult.model_validate({})
    assert (result.type, result.stdout, result.stderr, result.return_code, result.content) == (
        "code_execution_result", "", "", 0, [])


def test_responses_keep_extension_fields() -> None:
    handle = SessionHandle.model_validate({"session_id": "s1", "image": "python"})
    assert handle.model_dump()["image"] == "python"


@pytest.mark.parametrize("hint", [0, -5])
def test_lifetime_hints_must_be_positive(hint: int) -> None:
    with pytest.raises(ValidationError):
        CreateSessionRequest.model_validate({"idle_timeout_seconds": hint})


def test_what_sandpool_serves_is_what_the_contract_models_read() -> None:
    """The servers render `SessionDetails` and `FileListing`; a client reading them with the contract's
    own models gets every contract field and keeps sandpool's as extensions."""
    served = SessionDetails(session_id="s-1", idle_timeout_seconds=600, created_at=1.5, pool="default",
                            limits={"max_concurrent_sessions": 4}, deadline=None)
    wire = served.model_dump_json(exclude_unset=True)
    handle = SessionHandle.model_validate_json(wire)
    assert (handle.session_id, handle.idle_timeout_seconds, handle.created_at) == ("s-1", 600, 1.5)
    assert handle.model_extra == {"pool": "default", "limits": {"max_concurrent_sessions": 4}, "deadline": None}
    listing = FileListing(files=[FileEntry(path="a.txt", size_bytes=3, mime_type="text/plain", type="file")],
                          truncated=True)
    read = FileList.model_validate_json(listing.model_dump_json())
    assert read.files[0].path == "a.txt" and read.files[0].model_extra == {"type": "file"}
    assert read.model_extra == {"truncated": True}


def test_a_foreign_backends_extensions_do_not_break_the_contract_models() -> None:
    """sandpool's extension fields are typed only in sandpool's own models: another backend may use
    the same names for anything, and a client still reads its handle."""
    handle = SessionHandle.model_validate({"session_id": "s-1", "pool": 5, "limits": "none"})
    assert handle.session_id == "s-1"
    with pytest.raises(ValidationError):
        SessionDetails.model_validate({"session_id": "s-1", "pool": 5})


def test_a_listing_entry_names_its_kind() -> None:
    with pytest.raises(ValidationError):
        FileEntry(path="x", size_bytes=0, type="socket")  # type: ignore[arg-type]  # the point of the test
