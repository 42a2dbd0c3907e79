"""The client used exactly as documented, against a real `sandpool up --no-auth` (pool of 2, ceiling 2)."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator

import pytest
from client_stack import Stack

from sandpool.client import (
    AsyncClient,
    AtCapacity,
    BadRequest,
    Client,
    InvalidRequest,
    NotFound,
    PathOutsideWorkspace,
    PayloadTooLarge,
    Session,
)

pytestmark = pytest.mark.timeout(60)

# A refill after each destroyed session takes a sandbox start: let CreateSession wait
# for one through its own retries (Retry-After) rather than through the tests.
RETRIES = {"max_retries": 20, "max_retry_wait": 30.0}


@pytest.fixture
def client(stack: Stack) -> Iterator[Client]:
    with Client(stack.url, stack.token, **RETRIES) as c:  # type: ignore[arg-type]  # RETRIES: Client's own arguments
        yield c


def test_python_state_persists_and_the_handle_reports_what_is_in_force(client: Client) -> None:
    with client.session(idle_timeout_seconds=120, max_lifetime_seconds=600) as s:
        assert s.id and s.info.idle_timeout_seconds == 120 and s.info.max_lifetime_seconds == 600
        assert s.info.created_at is not None
        first = s.run_python("x = 41")
        assert first.ok and first.stdout == "" and first.return_code == 0
        second = s.run_python("print(x + 1)", tool_use_id="call-2")
        assert second.stdout == "42\n" and second.tool_use_id == "call-2"
        assert second.type == "code_execution_tool_result"
        assert second.execution_time_ms is not None and second.raw["result_block"]["tool_use_id"] == "call-2"
        failed = s.run_python("raise ValueError('boom')")
        assert not failed.ok and failed.return_code != 0 and "ValueError: boom" in failed.stderr


def test_bash_reports_exit_status_and_both_streams(client: Client) -> None:
    with client.session() as s:
        result = s.run_bash("echo out; echo err >&2; exit 3")
        assert (result.stdout, result.return_code, result.ok) == ("out\n", 3, False)
        assert result.stderr.startswith("err\n")  # then a note that the shell exited and was replaced
        assert result.type == "bash_code_execution_tool_result"
        assert s.run_bash("pwd && touch made-by-bash").ok
        assert "made-by-bash" in {f.path for f in s.list_files()}


def test_text_editor_commands(client: Client) -> None:
    with client.session() as s:
        assert s.create("notes.txt", "alpha\nbeta\n").ok
        assert s.str_replace("notes.txt", "beta", "gamma").ok
        assert s.insert("notes.txt", 0, "zero").ok
        view = s.view("notes.txt")
        assert view.type == "text_editor_code_execution_tool_result"
        assert "zero" in view.stdout and "gamma" in view.stdout and "beta" not in view.stdout
        assert s.download("notes.txt") == b"zero\nalpha\ngamma\n"
        assert s.undo_edit("notes.txt").ok
        assert s.download("notes.txt") == b"alpha\ngamma\n"
        missing = s.str_replace("notes.txt", "not there", "x")
        assert not missing.ok  # a failed edit is a result, not an error
        assert s.view("notes.txt", (1, 1)).stdout.count("alpha") == 1


def test_files_up_and_down_and_seen_by_code(client: Client) -> None:
    payload = bytes(range(256)) * 4
    with client.session() as s:
        stored = s.upload("data/blob.bin", payload)
        assert (stored.path, stored.size_bytes) == ("data/blob.bin", len(payload))
        assert s.upload("data/from-file.txt", io.BytesIO(b"streamed")).size_bytes == 8
        listing = {f.path: f for f in s.list_files("data")}
        assert listing["data/blob.bin"].size_bytes == len(payload)
        assert s.download("data/blob.bin") == payload
        check = s.run_python("print(len(open('data/blob.bin','rb').read()), open('data/from-file.txt').read())")
        assert check.stdout == f"{len(payload)} streamed\n"


def test_files_an_execution_produced_are_listed_and_fetched(client: Client) -> None:
    with client.session() as s:
        result = s.run_python("open('report.csv', 'w').write('a,b\\n1,2\\n')")
        assert result.ok
        assert [f.filename for f in result.files] == ["report.csv"]
        assert s.produced_files(result) == {"report.csv": b"a,b\n1,2\n"}
        # A later call that writes nothing new reports nothing.
        assert s.run_python("1 + 1").files == ()


def test_timeouts_are_results_and_the_session_carries_on(client: Client) -> None:
    with client.session() as s:
        result = s.run_python("import time\ntime.sleep(30)", timeout_seconds=1)
        assert result.timed_out and not result.ok and result.limit == "timeout"
        assert result.return_code != 0 and "timeout" in result.stderr
        assert s.run_python("print('still here')").stdout == "still here\n"


def test_errors_map_to_named_exceptions(client: Client) -> None:
    with client.session() as s:
        with pytest.raises(PathOutsideWorkspace) as outside:
            s.download("../../etc/passwd")
        assert outside.value.status == 403 and not outside.value.retryable
        with pytest.raises(NotFound):
            s.download("no-such-file")
        with pytest.raises(InvalidRequest) as invalid:
            s.edit("str_replace", "a.txt")  # missing old_str/new_str
        assert invalid.value.status == 422
        with pytest.raises(BadRequest) as unknown:
            s.execute("no_such_tool", {"code": "1"})
        assert unknown.value.status == 400 and not isinstance(unknown.value, InvalidRequest)
        assert s.run_python("print('usable')").stdout == "usable\n"  # none of that hurt the session
    with pytest.raises(NotFound) as gone:
        s.run_python("1")
    assert gone.value.status == 404 and not gone.value.retryable
    s.destroy()  # destroying twice is fine


def test_an_oversize_upload_is_refused_and_nothing_is_written(stack: Stack, client: Client) -> None:
    cap = stack.limits.get("max_body_bytes")
    if cap is None:
        pytest.skip("`sandpool up` takes no --max-body-bytes")
    with client.session() as s:
        with pytest.raises(PayloadTooLarge) as info:
            s.upload("big.bin", b"x" * (cap + 1))
        assert info.value.status == 413 and not info.value.retryable
        assert "big.bin" not in {f.path for f in s.list_files()}
        assert s.upload("small.bin", b"ok").size_bytes == 2


def test_capacity_exhausted_raises_at_capacity_after_bounded_retries(stack: Stack, client: Client) -> None:
    ceiling = stack.limits.get("max_sandboxes")
    if ceiling is None:
        pytest.skip("`sandpool up` takes no --max-sandboxes")
    held: list[Session] = []
    try:
        for _ in range(ceiling):
            held.append(client.create_session())
        with Client(stack.url, stack.token, max_retries=1, max_retry_wait=5) as impatient:
            with pytest.raises(AtCapacity) as info:
                impatient.create_session()
        err = info.value
        # The server's Retry-After is an estimate from the pool's release rate: the client follows it
        # while its own retry budget (5 s, 1 retry) allows, then gives up with the estimate on the
        # error. (Whether each refusal came at once or after a short wait for a release depends on
        # how fast the earlier tests churned this stack's pool: both are `at_capacity`.)
        assert (err.status, err.reason, err.retryable) == (503, "at_capacity", True)
        assert 1 <= err.attempts <= 2
        assert err.retry_after is not None and 1 <= err.retry_after <= 60
    finally:
        for s in held:
            s.destroy()
    with client.session() as s:  # capacity comes back once sessions are released
        assert s.run_python("print(1)").stdout == "1\n"


async def test_async_client_runs_sessions_concurrently(stack: Stack) -> None:
    async with AsyncClient(stack.url, stack.token, **RETRIES) as client:  # type: ignore[arg-type]  # as above

        async def one(n: int) -> str:
            async with client.session() as s:
                await s.run_python(f"n = {n}")
                await s.upload("n.txt", str(n).encode())
                await s.run_bash("cat n.txt n.txt > m.txt")
                result = await s.run_python("print(n, open('m.txt').read())")
                return result.stdout

        assert await asyncio.gather(one(1), one(2)) == ["1 11\n", "2 22\n"]
        async with client.session() as s:
            await s.create("a.txt", "hello")
            assert await s.download("a.txt") == b"hello"
            assert [f.path for f in await s.list_files()] == ["a.txt"]
            session_id = s.id
        with pytest.raises(NotFound):
            await client.attach(session_id).run_python("1")
