"""`sandpool mcp` as a subprocess speaking stdio to the `mcp` SDK's own client, against `sandpool up` (auth on,
the token from a file or `SANDPOOL_TOKEN`), in both revisions. (Figures, tenancy and usage are the same code
over HTTP: tests/mcp/test_mcp_http.py.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import httpx
import mcp_types as types
import pytest
from mcp import Client, StdioServerParameters
from mcp_harness import CURRENT, LEGACY
from sandbox_env import host_python
from testkit import wait_for

sys.path.insert(0, str(Path(__file__).parent.parent / "e2e"))
from up_harness import Up


@pytest.fixture(scope="module")
def up():
    # (Sandboxes on the built environment when `.ci/run` made one, else the host's Python: never a build here.)
    started = Up(env={"SANDPOOL_SANDBOX_PYTHON": host_python()})
    try:
        url, token = started.printed("SANDPOOL_URL="), started.printed("SANDPOOL_TOKEN=")
        yield started, url, token
    finally:
        started.cleanup()


def server(url: str, **env: str) -> StdioServerParameters:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SANDPOOL_")}
    return StdioServerParameters(command=sys.executable, args=["-m", "sandpool", "mcp"],
                                 env={**base, "SANDPOOL_URL": url, **env})


def ok(result: types.CallToolResult) -> dict:
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


async def test_stdio_previous_revision_keeps_one_default_session(up, tmp_path: Path) -> None:
    _, url, token = up
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    async with Client(server(url, SANDPOOL_TOKEN_FILE=str(token_file)), mode=LEGACY) as client:
        assert len((await client.list_tools()).tools) == 6
        first = ok(await client.call_tool("code_execution", {"code": "n = 20"}))
        bash = ok(await client.call_tool("bash_code_execution", {"command": "echo $((20 + 1)) > n.txt"}))
        assert bash["session_id"] == first["session_id"] and first["new_session"] and not bash["new_session"]
        edit = ok(await client.call_tool("text_editor_code_execution", {"command": "str_replace", "path": "n.txt",
                                                                        "old_str": "21", "new_str": "22"}))
        assert edit["session_id"] == first["session_id"]
        read = ok(await client.call_tool("code_execution", {"code": "print(n + int(open('n.txt').read()))"}))
        assert read["stdout"] == "42\n"

        # Cancellation (a cancel notification): the sleeping call stops, the interpreter keeps its state.
        started = anyio.Event()

        async def first_output(value: float, total: float | None, message: str | None) -> None:
            started.set()

        async with anyio.create_task_group() as tg:
            async def long_call() -> None:
                await client.call_tool("code_execution", {"code": "import time\nprint('tick', flush=True)\n"
                                                                  "time.sleep(50)", "timeout_seconds": 55},
                                       progress_callback=first_output)

            tg.start_soon(long_call)
            await started.wait()
            tg.cancel_scope.cancel()
        with anyio.fail_after(30):
            assert ok(await client.call_tool("code_execution", {"code": "print(n)"}))["stdout"] == "20\n"
        sid = first["session_id"]
    # The stdio server's exit ended its default session.
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10) as http:
        wait_for(lambda: http.get(f"/sessions/{sid}").status_code == 404, timeout=15, what="the session ended")


async def test_stdio_current_revision_names_its_sessions(up) -> None:
    _, url, token = up
    async with Client(server(url, SANDPOOL_TOKEN=token), mode=CURRENT) as client:
        one = ok(await client.call_tool("code_execution", {"code": "x = 1"}))
        two = ok(await client.call_tool("bash_code_execution", {"command": "ls x.txt"}))
        assert one["session_id"] != two["session_id"] and two["return_code"] != 0
        assert ok(await client.call_tool("code_execution", {"code": "print(x)", "session_id": one["session_id"]}))[
            "stdout"] == "1\n"
        for facts in (one, two):
            ok(await client.call_tool("end_session", {"session_id": facts["session_id"]}))
        ended = await client.call_tool("code_execution", {"code": "print(x)", "session_id": one["session_id"]})
        assert ended.is_error and ended.structured_content is not None and ended.structured_content["ended"]
