"""text_editor_code_execution: every command, failures in the payload, 422 for missing fields."""

from __future__ import annotations

import json

import pytest
from agent_harness import Agent, S, content


def test_create_view_and_ranges(agent: Agent) -> None:
    r = agent.edit("create", "ed/notes.txt", file_text="one\ntwo\nthree\n")
    assert content(r)["return_code"] == 0
    assert r["result_block"]["type"] == "text_editor_code_execution_tool_result"
    assert "one" not in content(r)["stdout"]  # create does not echo the file back
    assert (agent.workspace / "ed/notes.txt").read_text() == "one\ntwo\nthree\n"
    view = content(agent.edit("view", "ed/notes.txt"))
    assert view["stdout"] == "     1\tone\n     2\ttwo\n     3\tthree\n"
    ranged = content(agent.edit("view", "ed/notes.txt", view_range=[2, -1]))
    assert ranged["stdout"] == "     2\ttwo\n     3\tthree\n"
    bad = content(agent.edit("view", "ed/notes.txt", view_range=[5, 6]))
    assert bad["return_code"] == 1 and "view_range" in bad["stderr"]
    listing = content(agent.edit("view", "ed"))
    assert "ed/notes.txt" in listing["stdout"]


def test_str_replace_needs_exactly_one_occurrence(agent: Agent) -> None:
    agent.edit("create", "ed/r.py", file_text="a = 1\nb = 1\n")
    none = content(agent.edit("str_replace", "ed/r.py", old_str="c = 1", new_str="x"))
    assert none["return_code"] == 1 and "did not appear" in none["stderr"]
    many = content(agent.edit("str_replace", "ed/r.py", old_str="= 1", new_str="= 2"))
    assert many["return_code"] == 1 and "2 times" in many["stderr"]
    assert (agent.workspace / "ed/r.py").read_text() == "a = 1\nb = 1\n"
    ok = content(agent.edit("str_replace", "ed/r.py", old_str="b = 1", new_str="b = 2"))
    assert ok["return_code"] == 0 and "b = 2" in ok["stdout"]
    assert (agent.workspace / "ed/r.py").read_text() == "a = 1\nb = 2\n"


def test_insert_and_undo(agent: Agent) -> None:
    agent.edit("create", "ed/i.txt", file_text="b\nc\n")
    assert content(agent.edit("insert", "ed/i.txt", insert_line=0, new_str="a"))["return_code"] == 0
    assert (agent.workspace / "ed/i.txt").read_text() == "a\nb\nc\n"
    assert content(agent.edit("insert", "ed/i.txt", insert_line=3, new_str="d\ne\n"))["return_code"] == 0
    assert (agent.workspace / "ed/i.txt").read_text() == "a\nb\nc\nd\ne\n"
    bad = content(agent.edit("insert", "ed/i.txt", insert_line=99, new_str="z"))
    assert bad["return_code"] == 1 and "insert_line" in bad["stderr"]
    assert content(agent.edit("undo_edit", "ed/i.txt"))["return_code"] == 0
    assert (agent.workspace / "ed/i.txt").read_text() == "a\nb\nc\n"
    assert content(agent.edit("undo_edit", "ed/i.txt"))["return_code"] == 0
    assert (agent.workspace / "ed/i.txt").read_text() == "b\nc\n"
    assert content(agent.edit("undo_edit", "ed/i.txt"))["return_code"] == 0  # undoes the create
    assert not (agent.workspace / "ed/i.txt").exists()
    empty = content(agent.edit("undo_edit", "ed/i.txt"))
    assert empty["return_code"] == 1 and "no edit to undo" in empty["stderr"]


def test_edit_failures_are_payload_failures(agent: Agent) -> None:
    missing = agent.exec("text_editor_code_execution", command="view", path="ed/nope.txt")
    assert missing.status_code == 200
    assert missing.headers["X-Sandpool-Outcome"] == "failed"
    assert content(missing.json())["return_code"] == 1
    outside = content(agent.edit("view", "../../etc/passwd"))
    assert outside["return_code"] == 1 and "leaves the workspace" in outside["stderr"]
    assert "/etc" not in outside["stderr"].replace("../../etc/passwd", "")
    absolute = content(agent.edit("create", "/tmp/evil", file_text="x"))
    assert absolute["return_code"] == 1


@pytest.mark.parametrize(("command", "fields"), [
    ("create", {}),
    ("str_replace", {"old_str": "a"}),
    ("insert", {"new_str": "a"}),
    ("frobnicate", {}),
])
def test_missing_command_fields_are_422(agent: Agent, command: str, fields: dict[str, str]) -> None:
    resp = agent.exec("text_editor_code_execution", command=command, path="ed/x.txt", **fields)
    assert resp.status_code == 422
    assert resp.json()["reason"] == "invalid_request"
    assert not (agent.workspace / "ed/x.txt").exists()


def test_unencodable_text_and_paths_fail_cleanly(agent: Agent) -> None:
    """Lone surrogates (legal as JSON escapes) are a 422 or a failed result, never a 500 or a write."""

    def raw(tool: str, **fields: str) -> tuple[int, dict[str, object] | None]:
        body = json.dumps({"tool": tool, "input": fields})  # httpx's own encoder would refuse them
        resp = agent.client.post(f"{S}/exec", content=body, headers={"content-type": "application/json"})
        assert resp.status_code in (200, 422), resp.text
        return resp.status_code, content(resp.json()) if resp.status_code == 200 else None

    for tool, fields in (
        ("text_editor_code_execution", {"command": "create", "path": "ed/sur.txt", "file_text": "a\ud800b"}),
        ("text_editor_code_execution", {"command": "view", "path": "ed/\ud800.txt"}),
        ("bash_code_execution", {"command": "echo '\ud800' > ed/sur.txt"}),
        ("code_execution", {"code": "s = '\ud800'\nprint(len(s))"}),
    ):
        status, result = raw(tool, **fields)
        if status == 200 and tool == "text_editor_code_execution":
            assert result is not None and result["return_code"] == 1
    assert content(agent.sh("echo fine"))["stdout"] == "fine\n"


def test_view_output_is_capped(tmp_path_factory: pytest.TempPathFactory) -> None:
    from agent_harness import start_agent

    small = start_agent(tmp_path_factory.mktemp("edcap"), "--max-output-bytes", "2048")
    try:
        small.edit("create", "long.txt", file_text="line\n" * 5000)
        resp = small.exec("text_editor_code_execution", command="view", path="long.txt")
        assert resp.headers["X-Sandpool-Outcome"] == "limit"
        out = content(resp.json())["stdout"]
        assert out.startswith("     1\tline\n") and "more bytes discarded" in out
        assert len(out) < 2048 + 200
    finally:
        small.stop()
