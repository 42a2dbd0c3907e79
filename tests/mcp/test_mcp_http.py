"""`/mcp` on the api, driven by the `mcp` SDK's own client over streamable HTTP, in both revisions, its requests
alternating between two `sandpool api` processes on one Redis (auth on, real agents behind them).

The current revision (2026-07-28) is stateless: a call names its session or leases a new one. The previous
one (2025-11-25, the initialize handshake) has an `Mcp-Session-Id` whose default session lives in Redis, so
either replica serves the next request, and deleting the MCP session releases it.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import anyio
import httpx
import mcp_types as types
import pytest
from mcp import MCPError
from mcp_harness import CURRENT, INSPECTOR, LEGACY, ApiReplica, inspector, mcp_client
from testkit import wait_for

from sandpool.edge.keys_cli import mint_token

PNG = b"\x89PNG\r\n\x1a\n"
MODES = [pytest.param(CURRENT, id="2026-07-28"), pytest.param(LEGACY, id="2025-11-25")]


def text_of(result: types.CallToolResult) -> str:
    first = result.content[0]
    assert isinstance(first, types.TextContent)
    return first.text


def ok(result: types.CallToolResult) -> dict:
    assert not result.is_error, text_of(result)
    assert result.structured_content is not None
    return result.structured_content


@pytest.mark.parametrize("mode", MODES)
async def test_a_session_across_calls_and_replicas(stack, mode) -> None:
    await stack.sandboxes.add(1)
    async with mcp_client(stack.urls, stack.token("ws-a"), mode) as client:
        names = [tool.name for tool in (await client.list_tools()).tools]
        assert names == ["code_execution", "bash_code_execution", "text_editor_code_execution", "upload_file",
                         "read_file", "end_session"]

        first = ok(await client.call_tool("code_execution", {"code": "answer = 41\nprint('started')"}))
        sid = first["session_id"]
        assert first["new_session"] is True and first["stdout"] == "started\n" and sid in text_of(
            await client.call_tool("code_execution", {"code": "print(answer + 1)", "session_id": sid}))
        # The previous revision's client need not pass it: its Mcp-Session-Id names the same session.
        same = {} if mode == LEGACY else {"session_id": sid}
        again = ok(await client.call_tool("code_execution", {"code": "print(answer + 1)", **same}))
        assert again == {**again, "session_id": sid, "new_session": False, "stdout": "42\n", "return_code": 0}

        bash = ok(await client.call_tool("bash_code_execution", {"command": "echo hi > note.txt; cat note.txt; "
                                                                            "exit 3", **same}))
        assert bash["stdout"] == "hi\n" and bash["return_code"] == 3 and "return code: 3" in text_of(
            await client.call_tool("bash_code_execution", {"command": "exit 3", **same}))

        ok(await client.call_tool("text_editor_code_execution", {"command": "create", "path": "app.py",
                                                                  "file_text": "print('v1')\n", **same}))
        ok(await client.call_tool("text_editor_code_execution", {"command": "str_replace", "path": "app.py",
                                                                  "old_str": "v1", "new_str": "v2", **same}))
        view = ok(await client.call_tool("text_editor_code_execution", {"command": "view", "path": "app.py",
                                                                         **same}))
        assert "print('v2')" in view["stdout"]
        assert ok(await client.call_tool("bash_code_execution", {"command": "python3 app.py", **same}))[
            "stdout"] == "v2\n"

        stored = ok(await client.call_tool("upload_file", {"path": "data/in.bin",
                                                           "base64": base64.b64encode(b"\x00\x01\xff").decode(),
                                                           **same}))
        assert stored["size_bytes"] == 3
        read = await client.call_tool("read_file", {"path": "note.txt", **same})
        assert ok(read)["size_bytes"] == 3
        resource = read.content[1]
        assert isinstance(resource, types.EmbeddedResource)
        assert isinstance(resource.resource, types.TextResourceContents) and resource.resource.text == "hi\n"

        # A bad input is a tool error the model reads, never a protocol error.
        bad = await client.call_tool("text_editor_code_execution", {"command": "insert", "path": "app.py", **same})
        assert bad.is_error and "insert_line" in text_of(bad)
        wrong = await client.call_tool("code_execution", {"code": 5, **same})
        assert wrong.is_error and "code" in text_of(wrong)

        ended = ok(await client.call_tool("end_session", {"session_id": sid}))
        assert ended == {"session_id": sid, "ended": True}
        gone = await client.call_tool("code_execution", {"code": "print(answer)", "session_id": sid})
        assert gone.is_error and "has ended or does not exist" in text_of(gone)
        assert gone.structured_content is not None and gone.structured_content["ended"] is True


async def test_a_figure_comes_back_as_an_image(stack) -> None:
    if not stack.sandboxes.figures:
        pytest.skip("sandbox environment unavailable: set SANDPOOL_TEST_SANDBOX_PYTHON (matplotlib)")
    await stack.sandboxes.add(1)
    async with mcp_client(stack.urls, stack.token("ws-fig"), CURRENT) as client:
        result = await client.call_tool("code_execution", {
            "code": "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 1, 9])\nplt.show()\nprint('shown')"})
        facts = ok(result)
        assert facts["stdout"] == "shown\n" and len(facts["files"]) == 1
        (image,) = [block for block in result.content if isinstance(block, types.ImageContent)]
        assert image.mime_type == "image/png" and base64.b64decode(image.data).startswith(PNG)
        await client.call_tool("end_session", {"session_id": facts["session_id"]})


async def test_sessions_are_isolated_and_tenants_too(stack) -> None:
    await stack.sandboxes.add(2)
    async with mcp_client(stack.urls, stack.token("ws-a"), CURRENT) as a:
        one = ok(await a.call_tool("code_execution", {"code": "x = 'one'\nopen('f.txt', 'w').write('one')"}))
        two = ok(await a.call_tool("code_execution", {"code": "print('x' in dir())\nimport os\n"
                                                            "print(os.path.exists('f.txt'))"}))
        assert one["session_id"] != two["session_id"] and two["stdout"] == "False\nFalse\n"

        async with mcp_client(stack.urls, stack.token("ws-b"), CURRENT) as b:
            stolen = await b.call_tool("code_execution", {"code": "print(x)", "session_id": one["session_id"]})
            unknown = await b.call_tool("code_execution", {"code": "print(x)", "session_id": "no-such-session"})
            assert stolen.is_error and unknown.is_error
            assert text_of(stolen).replace(one["session_id"], "ID") == text_of(unknown).replace(
                "no-such-session", "ID")
            ended = await b.call_tool("end_session", {"session_id": one["session_id"]})
            assert not ended.is_error  # (as DestroySession: 204, and the session is left untouched)
        assert ok(await a.call_tool("code_execution", {"code": "print(x)", "session_id": one["session_id"]}))[
            "stdout"] == "one\n"
        for facts in (one, two):
            ok(await a.call_tool("end_session", {"session_id": facts["session_id"]}))


def test_an_mcp_session_is_its_workspace_s_alone(stack) -> None:
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
    a_url, b_url = stack.urls

    refused = httpx.post(a_url + "/mcp", json=init, headers=headers)
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"

    opened = httpx.post(a_url + "/mcp", json=init, headers={**headers, **auth(stack, "ws-a")})
    assert opened.status_code == 200, opened.text
    mcp_id = opened.headers["mcp-session-id"]
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}
    own = {**headers, **auth(stack, "ws-a"), "Mcp-Session-Id": mcp_id, "MCP-Protocol-Version": "2025-11-25"}
    assert httpx.post(b_url + "/mcp", json=listing, headers=own).status_code == 200  # the other replica
    other = {**own, **auth(stack, "ws-b")}
    unknown = {**own, "Mcp-Session-Id": "no-such-mcp-session"}
    theirs = httpx.post(b_url + "/mcp", json=listing, headers=other)
    nobody = httpx.post(b_url + "/mcp", json=listing, headers=unknown)
    assert theirs.status_code == nobody.status_code == 404 and theirs.json() == nobody.json()
    assert httpx.delete(a_url + "/mcp", headers=other).status_code == 404
    assert httpx.delete(a_url + "/mcp", headers=own).status_code == 200
    assert httpx.post(a_url + "/mcp", json=listing, headers=own).status_code == 404


async def test_deleting_the_mcp_session_releases_its_session(stack) -> None:
    await stack.sandboxes.add(1)
    async with mcp_client(stack.urls, stack.token("ws-del"), LEGACY) as client:
        sid = ok(await client.call_tool("code_execution", {"code": "print(1)"}))["session_id"]
        assert stack.r.exists(stack.keys.session(sid))
    # The client's exit sent DELETE with its Mcp-Session-Id: the sandpool session is released.
    wait_for(lambda: not stack.r.exists(stack.keys.session(sid)), timeout=10, what="the session released")


@pytest.mark.parametrize("mode", MODES)
async def test_progress_while_running_and_cancellation(stack, mode) -> None:
    await stack.sandboxes.add(1)
    async with mcp_client(stack.urls, stack.token("ws-long"), mode) as client:
        sid = ok(await client.call_tool("code_execution", {"code": "state = 'kept'"}))["session_id"]
        notes: list[tuple[float, str | None]] = []

        async def progress(value: float, total: float | None, message: str | None) -> None:
            notes.append((value, message))

        streamed = ok(await client.call_tool("bash_code_execution", {
            "command": "echo one; sleep 0.3; echo two 1>&2; sleep 0.3; echo three", "session_id": sid},
            progress_callback=progress))
        assert streamed["stdout"] == "one\nthree\n" and streamed["stderr"] == "two\n"
        assert [m for _, m in notes] == ["stdout: one\n", "stderr: two\n", "stdout: three\n"]
        assert [v for v, _ in notes] == sorted(v for v, _ in notes)

        # A call that would run for 50 s is cancelled once its first output arrived.
        started = anyio.Event()

        async def first_output(value: float, total: float | None, message: str | None) -> None:
            started.set()

        async with anyio.create_task_group() as tg:
            async def long_call() -> None:
                await client.call_tool("code_execution", {
                    "code": "import time\nprint('tick', flush=True)\ntime.sleep(50)", "session_id": sid,
                    "timeout_seconds": 55}, progress_callback=first_output)

            tg.start_soon(long_call)
            await started.wait()
            tg.cancel_scope.cancel()
        # The session's next call runs at once (calls to one session run in order: the sleeping one ended), and
        # the interpreter kept its state (the call was interrupted, not the interpreter killed).
        with anyio.fail_after(30):
            after = ok(await client.call_tool("code_execution", {"code": "print(state)", "session_id": sid}))
        assert after["stdout"] == "kept\n"
        # A limit that fires is said in the text and the structured content.
        stopped = await client.call_tool("code_execution", {"code": "import time\ntime.sleep(30)",
                                                            "session_id": sid, "timeout_seconds": 1})
        assert ok(stopped)["limit_exceeded"] == "timeout" and "limit fired: timeout" in text_of(stopped)
        ok(await client.call_tool("end_session", {"session_id": sid}))


async def test_tool_calls_are_metered_as_contract_calls(stack) -> None:
    await stack.sandboxes.add(1)
    async with mcp_client(stack.urls, stack.token("ws-meter"), CURRENT) as client:
        sid = ok(await client.call_tool("code_execution", {"code": "print(1)"}))["session_id"]
        ok(await client.call_tool("bash_code_execution", {"command": "true", "session_id": sid}))
        ok(await client.call_tool("upload_file", {"path": "a.txt", "text": "abcd", "session_id": sid}))
        ok(await client.call_tool("end_session", {"session_id": sid}))

    def usage() -> dict:
        got = httpx.get(stack.urls[1] + "/v1/usage", headers=auth(stack, "ws-meter"))
        assert got.status_code == 200, got.text
        total = got.json()["total"]
        return total if total["executions"] == 2 else {}

    total = wait_for(usage, timeout=10, what="usage of the tool calls")
    assert total["sessions_created"] == 1 and total["bytes_uploaded"] == 4
    assert total["by_tool"]["code_execution"]["executions"] == 1
    assert total["by_tool"]["bash_code_execution"]["executions"] == 1


async def test_policy_and_revocation_apply_as_to_contract_calls(stack) -> None:
    admin = {"Authorization": f"Bearer {mint_token(stack.private_key, 'ops', admin=True)}"}
    async with httpx.AsyncClient(timeout=30) as http:
        put = await http.put(stack.urls[0] + "/v1/workspaces/ws-quota/policy", json={"max_concurrent_sessions": 1},
                             headers=admin)
        assert put.status_code == 200, put.text
        await stack.sandboxes.add(1)
        token = mint_token(stack.private_key, "ws-quota", jti="mcp-revoked-later")
        async with mcp_client(stack.urls, token, CURRENT) as client:
            first = ok(await client.call_tool("code_execution", {"code": "print(1)"}))
            refused = await client.call_tool("code_execution", {"code": "print(2)"})  # a second session: over quota
            assert refused.is_error and refused.structured_content is not None
            assert (refused.structured_content["status"], refused.structured_content["reason"]) == (
                429, "quota_exceeded")
            assert "max concurrent sessions" in text_of(refused)

            revoked = await http.post(stack.urls[1] + "/v1/revocations", json={"jti": "mcp-revoked-later",
                                                                                "ttl": 600}, headers=admin)
            assert revoked.status_code == 201, revoked.text
            with pytest.raises(MCPError):  # the transport refused it: no tool runs for a revoked token
                await client.call_tool("code_execution", {"code": "print(3)", "session_id": first["session_id"]})
        listing = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        answer = await http.post(stack.urls[0] + "/mcp", json=listing, headers={
            "Authorization": f"Bearer {token}", "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": CURRENT})
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
        assert answer.json()["cause"] == "revoked"


async def test_standalone_serves_the_one_trusted_client(stack, redis_server) -> None:
    """`--no-auth`: no token, as for the contract (its sessions are the standalone workspace's)."""
    await stack.sandboxes.add(1)
    alone = ApiReplica(redis_server.url, stack.keys.prefix, None)
    try:
        alone.wait_ready()
        async with mcp_client([alone.url], None, CURRENT) as client:
            facts = ok(await client.call_tool("code_execution", {"code": "print('alone')"}))
            assert facts["stdout"] == "alone\n"
            ok(await client.call_tool("end_session", {"session_id": facts["session_id"]}))
    finally:
        alone.stop()


def auth(stack, workspace: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {stack.token(workspace)}"}


async def test_the_mcp_inspector_lists_and_calls_the_tools(stack) -> None:
    """A client nobody here wrote: the MCP Inspector's command-line client (npm), in the revision it speaks."""
    cli = inspector()
    if cli is None:
        pytest.skip(f"MCP Inspector CLI unavailable: set {INSPECTOR} (`.ci/run` installs it with "
                    ".ci/install-mcp-inspector)")
    await stack.sandboxes.add(1)
    base = [cli, "--cli", stack.urls[0] + "/mcp", "--transport", "http",
            "--header", f"Authorization: Bearer {stack.token('ws-inspector')}"]

    # (It reads its own package.json at `../package.json` from the working directory: run it from its build/.)
    where = Path(os.path.realpath(cli)).parent

    def run(*args: str) -> dict:
        done = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60, cwd=where)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    listed = run("--method", "tools/list")
    assert [tool["name"] for tool in listed["tools"]][:3] == ["code_execution", "bash_code_execution",
                                                              "text_editor_code_execution"]
    called = run("--method", "tools/call", "--tool-name", "code_execution", "--tool-arg", "code=print(6 * 7)")
    assert not called.get("isError") and called["structuredContent"]["stdout"] == "42\n"
