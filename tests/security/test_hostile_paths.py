"""Hostile paths through the whole path (api -> a real sandbox's agent), every file operation.

The agent's own table (tests/agent/test_files.py `HOSTILE`) is read from that
file and extended here with paths that only make sense in a real sandbox:
symlinks planted by the sandboxed code to the host's root, to another live
sandbox's workspace, to the stack's data dir, a FIFO, /proc. For each: GetFile,
ListFiles, PutFile and the editor refuse it, the answer names no host path, and
nothing outside the session's workspace changed.
"""

from __future__ import annotations

import ast
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sp_harness import Stack

from sandpool.state.keys import Keys

AGENT_TABLE = Path(__file__).resolve().parents[1] / "agent" / "test_files.py"


def agent_hostile_table() -> list[tuple[str, int]]:
    """The agent suite's HOSTILE list, read (not imported: that module needs the agent suite's conftest)."""
    tree = ast.parse(AGENT_TABLE.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "HOSTILE" for t in node.targets):
            return [tuple(x) for x in ast.literal_eval(node.value)]  # type: ignore[misc]  # literal_eval: the table's pairs
    raise AssertionError("tests/agent/test_files.py has no HOSTILE table any more")


# (path, expected status of GetFile) planted by the sandbox's own code in `plant()` below.
SANDBOX_MADE = [
    ("host_root/etc/passwd", 403),         # symlink to /
    ("host_passwd", 403),                  # symlink to /etc/passwd
    ("other_ws/secret.txt", 403),          # symlink into another live sandbox's workspace
    ("data_dir/sandboxes", 403),           # symlink to the stack's data dir
    ("proc_self/environ", 403),            # symlink to /proc/self
    ("inside/../../escape", 403),          # `..` even under a real directory
    ("%2e%2e/escape", 404),                # percent-encoding is not decoded twice: a plain (absent) name
    ("dot/./../../x", 403),
    ("deep/" + "a/" * 64 + "x", 404),      # long but inside: simply absent
    ("pipe", 400),                         # a FIFO: not a regular file, and never blocks
    ("devnull", 403),                      # symlink to /dev/null: outside
]


class Tenant:
    def __init__(self, stack: Stack, workspace: str) -> None:
        self.client = stack.client(workspace)
        response = self.client.post("/sessions", json={})
        assert response.status_code == 201, response.text
        self.sid = response.json()["session_id"]
        with stack.rdb() as r:
            sandbox = r.hget(Keys(stack.prefix).session(self.sid), "sandbox")
        self.dir = stack.root / "sandboxes" / str(sandbox)

    def sh(self, command: str) -> dict[str, Any]:
        response = self.client.post(f"/sessions/{self.sid}/exec",
                                    json={"tool": "bash_code_execution", "input": {"command": command}})
        assert response.status_code == 200, response.text
        return response.json()["result_block"]["content"]

    def close(self) -> None:
        self.client.delete(f"/sessions/{self.sid}")
        self.client.close()


@pytest.fixture(scope="module")
def pair(stack: Stack) -> Iterator[tuple[Tenant, Tenant]]:
    attacker, victim = Tenant(stack, "attacker"), Tenant(stack, "victim")
    victim.sh("echo victim-secret > secret.txt")
    other_ws = victim.dir / "workspace"
    attacker.sh(f"mkdir -p inside dot deep; ln -sfn / host_root; ln -sfn /etc/passwd host_passwd; "
                f"ln -sfn {other_ws} other_ws; ln -sfn {stack.root} data_dir; ln -sfn /proc/self proc_self; "
                f"ln -sfn /dev/null devnull; mkfifo pipe; echo mine > mine.txt")
    yield attacker, victim
    attacker.close()
    victim.close()


def snapshot(stack: Stack, victim: Tenant) -> dict[str, Any]:
    return {"victim": victim.client.get(f"/sessions/{victim.sid}/files", params={"path": "secret.txt"}).content,
            "root": sorted(os.listdir(stack.root)), "slash": sorted(os.listdir("/")),
            "passwd": Path("/etc/passwd").stat().st_mtime_ns}


def assert_clean(response: httpx.Response, stack: Stack, path: str) -> None:
    """No host path in the answer beyond the client's own path echoed back."""
    text = response.text
    for echo in (path, json.dumps(path)[1:-1]):
        if echo:
            text = text.replace(echo, "")
    assert str(stack.root) not in text and "/etc/" not in text and "/tmp/" not in text, response.text
    assert "Traceback" not in response.text
    if response.status_code >= 400:
        body = response.json()
        assert body["detail"] and body["reason"], body


@pytest.mark.parametrize(("path", "status"), agent_hostile_table() + SANDBOX_MADE,
                         ids=[repr(p)[:40] for p, _ in agent_hostile_table() + SANDBOX_MADE])
def test_hostile_path_through_the_api(stack: Stack, pair: tuple[Tenant, Tenant], path: str, status: int) -> None:
    attacker, victim = pair
    before = snapshot(stack, victim)
    url = f"/sessions/{attacker.sid}"
    get = attacker.client.get(f"{url}/files", params={"path": path})
    assert get.status_code == status, (path, get.text)
    assert_clean(get, stack, path)
    assert b"victim-secret" not in get.content and b"root:" not in get.content
    listing = attacker.client.get(f"{url}/files/list", params={"path": path})
    assert listing.status_code in (status, 404) if status == 400 else listing.status_code == status, listing.text
    assert_clean(listing, stack, path)
    put = attacker.client.post(f"{url}/files", files={"file": ("x", b"pwned")}, data={"path": path})
    if status in (403, 422):
        assert put.status_code == status, (path, put.text)
    else:
        assert put.status_code in (201, 400, 404), (path, put.text)  # inside the workspace: may be written
    assert_clean(put, stack, path)
    view = attacker.client.post(f"{url}/exec", json={"tool": "text_editor_code_execution",
                                                     "input": {"command": "create", "path": path or ".",
                                                               "file_text": "pwned"}})
    assert view.status_code == 200, view.text
    if status in (403, 422):
        assert view.json()["result_block"]["content"]["return_code"] == 1, view.text
    assert_clean(view, stack, path)
    assert snapshot(stack, victim) == before
    # The attacker's own session still works: a refusal is not a crash.
    assert attacker.client.get(f"{url}/files", params={"path": "mine.txt"}).content == b"mine\n"
