"""The client over real HTTP against a scripted server: which calls retry, how errors surface, what is sent."""

from __future__ import annotations

import io
import json

import pytest
from client_scripted import Reply, ScriptedServer, ok_exec_body
from testkit import free_port

from sandpool.client import (
    AsyncClient,
    AtCapacity,
    Client,
    ConnectionFailed,
    NotFound,
    ProtocolError,
    QuotaExceeded,
    SandboxFailed,
    Unauthorized,
    Unavailable,
)

BUSY = Reply(503, {"detail": "no sandbox ready", "reason": "at_capacity"}, {"Retry-After": "0"})


def client_for(server: ScriptedServer, **kw: object) -> Client:
    kw.setdefault("max_retries", 3)
    kw.setdefault("max_retry_wait", 5.0)
    return Client(server.url, token="tok", **kw)  # type: ignore[arg-type]  # kw: more of Client's own arguments


def test_create_session_retries_503_honouring_retry_after_then_succeeds(scripted: ScriptedServer) -> None:
    scripted.script("POST", "/sessions", BUSY, Reply(429, {"reason": "quota_exceeded"}, {"Retry-After": "0"}))
    with client_for(scripted) as client:
        session = client.create_session(idle_timeout_seconds=30)
    assert session.id == "s-1" and session.info.idle_timeout_seconds == 60
    hits = scripted.hits("POST", "/sessions")
    assert len(hits) == 3
    assert json.loads(hits[0].body) == {"idle_timeout_seconds": 30}
    # One request id for every attempt of one call, so server logs tie them together.
    assert len({h.headers["x-request-id"] for h in hits}) == 1
    assert all(h.headers["authorization"] == "Bearer tok" for h in hits)


def test_capacity_retries_exhausted_raise_at_capacity_retryable(scripted: ScriptedServer) -> None:
    scripted.script("POST", "/sessions", *[BUSY] * 5)
    with client_for(scripted, max_retries=2) as client, pytest.raises(AtCapacity) as info:
        client.create_session()
    err = info.value
    assert (err.status, err.reason, err.retryable, err.retry_after, err.attempts) == (503, "at_capacity", True, 0, 3)
    assert err.request_id and len(scripted.hits("POST", "/sessions")) == 3


def test_a_retry_after_beyond_the_wait_budget_is_raised_at_once(scripted: ScriptedServer) -> None:
    scripted.script("POST", "/sessions", Reply(503, {"reason": "at_capacity"}, {"Retry-After": "120"}))
    with client_for(scripted, max_retry_wait=5) as client, pytest.raises(AtCapacity) as info:
        client.create_session()
    assert info.value.retry_after == 120 and info.value.attempts == 1
    assert len(scripted.hits("POST", "/sessions")) == 1


def test_execute_is_never_retried_once_sent(scripted: ScriptedServer) -> None:
    scripted.script("POST", "/sessions/s-1/exec", BUSY)
    with client_for(scripted) as client:
        session = client.attach("s-1")
        with pytest.raises(AtCapacity) as info:
            session.run_python("x = 1")
        assert info.value.retryable and info.value.attempts == 1
        assert len(scripted.hits("POST", "/sessions/s-1/exec")) == 1

        scripted.script("POST", "/sessions/s-1/exec", Reply(502, {"reason": "sandbox_failed"}))
        with pytest.raises(SandboxFailed):
            session.run_bash("true")


def test_upload_is_not_retried_on_429_but_reads_are(scripted: ScriptedServer) -> None:
    limited = Reply(429, {"reason": "quota_exceeded"}, {"Retry-After": "0"})
    scripted.script("POST", "/sessions/s-1/files", limited)
    scripted.script("GET", "/sessions/s-1/files", limited)
    with client_for(scripted) as client:
        session = client.attach("s-1")
        with pytest.raises(QuotaExceeded):
            session.upload("a.txt", io.BytesIO(b"hello"))
        assert session.download("a.txt") == b"bytes"
    assert len(scripted.hits("POST", "/sessions/s-1/files")) == 1
    assert len(scripted.hits("GET", "/sessions/s-1/files")) == 2


def test_non_retryable_errors_are_raised_on_the_first_answer(scripted: ScriptedServer) -> None:
    scripted.script("POST", "/sessions", Reply(401, {"detail": "token expired", "reason": "unauthorized"},
                                               {"WWW-Authenticate": "Bearer"}))
    with client_for(scripted) as client, pytest.raises(Unauthorized, match="token expired") as info:
        client.create_session()
    assert info.value.retryable is False and info.value.attempts == 1


def test_a_503_that_is_not_capacity_is_unavailable(scripted: ScriptedServer) -> None:
    scripted.script("GET", "/sessions/s-1/files/list", *[Reply(503, {"reason": "unavailable"})] * 2)
    with client_for(scripted, max_retries=1) as client, pytest.raises(Unavailable) as info:
        client.attach("s-1").list_files()
    assert not isinstance(info.value, AtCapacity)
    assert info.value.attempts == 2


def test_destroy_of_an_unknown_session_is_not_an_error(scripted: ScriptedServer) -> None:
    scripted.script("DELETE", "/sessions/s-1", Reply(404, {"reason": "not_found"}))
    with client_for(scripted) as client:
        client.destroy_session("s-1")  # a gateway answering 404 here: already in the desired state
        with pytest.raises(NotFound):
            client.attach("gone").download("a.txt")


def test_session_context_destroys_on_exit_even_when_the_body_raises(scripted: ScriptedServer) -> None:
    with client_for(scripted) as client:
        with pytest.raises(RuntimeError), client.session() as session:
            assert session.run_python("print('hi')").stdout == "hi\n"
            raise RuntimeError("user code failed")
    assert len(scripted.hits("DELETE", "/sessions/s-1")) == 1


def test_a_failed_destroy_does_not_hide_the_bodys_error(scripted: ScriptedServer) -> None:
    scripted.script("DELETE", "/sessions/s-1", Reply(500, {"reason": "internal_error"}))
    with client_for(scripted) as client:
        with pytest.raises(KeyError), client.session():
            raise KeyError("mine")


def test_a_non_conforming_answer_is_a_protocol_error(scripted: ScriptedServer) -> None:
    bare = ok_exec_body()["result_block"]
    scripted.script("POST", "/sessions/s-1/exec", Reply(200, bare))
    scripted.script("POST", "/sessions", Reply(201, raw=b"not json"))
    with client_for(scripted) as client:
        with pytest.raises(ProtocolError, match="contract v1"):
            client.attach("s-1").run_python("1")
        with pytest.raises(ProtocolError, match="non-JSON"):
            client.create_session()


def test_request_bodies_on_the_wire(scripted: ScriptedServer) -> None:
    with client_for(scripted) as client:
        s = client.attach("s-1")
        s.run_python("print(1)", timeout_seconds=5, tool_use_id="mine")
        s.str_replace("a.py", "x", "y")
        s.view("a.py", (1, 3))
        stored = s.upload("dir/a.txt", b"hello")
        listing = s.list_files("dir")
    bodies = [json.loads(h.body) for h in scripted.hits("POST", "/sessions/s-1/exec")]
    assert bodies == [
        {"tool": "code_execution", "input": {"code": "print(1)"}, "timeout_seconds": 5, "tool_use_id": "mine"},
        {"tool": "text_editor_code_execution",
         "input": {"command": "str_replace", "path": "a.py", "old_str": "x", "new_str": "y"}},
        {"tool": "text_editor_code_execution", "input": {"command": "view", "path": "a.py", "view_range": [1, 3]}},
    ]
    upload = scripted.hits("POST", "/sessions/s-1/files")[0]
    assert upload.headers["content-type"].startswith("multipart/form-data")
    assert b'name="path"' in upload.body and b"dir/a.txt" in upload.body and b"hello" in upload.body
    assert (stored.path, stored.size_bytes) == ("a.txt", 5)
    assert listing == []


def test_connection_refused_is_retried_then_raised_as_retryable() -> None:
    client = Client(f"http://127.0.0.1:{free_port()}", max_retries=2, max_retry_wait=2)
    with client, pytest.raises(ConnectionFailed) as info:
        client.attach("s").run_python("1")  # never sent, so even Execute may be offered again
    assert info.value.retryable and info.value.attempts == 3 and info.value.status is None


async def test_async_client_same_semantics(scripted: ScriptedServer) -> None:
    scripted.script("POST", "/sessions", BUSY)
    scripted.script("POST", "/sessions/s-1/exec", BUSY)
    async with AsyncClient(scripted.url, max_retries=2, max_retry_wait=5) as client:
        async with client.session() as session:
            with pytest.raises(AtCapacity):
                await session.run_python("1")
            assert (await session.run_python("2")).stdout == "hi\n"
            assert await session.download("x") == b"bytes"
    assert len(scripted.hits("POST", "/sessions")) == 2
    assert len(scripted.hits("POST", "/sessions/s-1/exec")) == 2
    assert len(scripted.hits("DELETE", "/sessions/s-1")) == 1


def test_which_errors_each_kind_of_call_retries() -> None:
    from sandpool.client import ConnectionLost
    from sandpool.client.calls import Timeouts, create_session, destroy_session, execute, get_file, put_file
    from sandpool.client.errors import error_from_response
    from sandpool.client.transport import may_retry

    t = Timeouts()
    busy, limited = error_from_response(503, {}, None), error_from_response(429, {}, None)
    died, bad = error_from_response(502, {}, None), error_from_response(400, {}, None)
    never_sent, broke = ConnectionFailed("x"), ConnectionLost("x")
    calls = {
        "create": create_session(t),
        "destroy": destroy_session(t, "s"),
        "get": get_file(t, "s", "a"),
        "exec": execute(t, "s", "code_execution", {"code": "1"}, timeout_seconds=None, tool_use_id=None),
        "put": put_file(t, "s", "a", b"x"),
    }
    table = {name: [may_retry(call, e) for e in (busy, limited, died, bad, never_sent, broke)]
             for name, call in calls.items()}
    assert table == {
        #          503    429    502    400    no-conn broke
        "create": [True, True, False, False, True, False],
        "destroy": [True, True, False, False, True, True],
        "get": [True, True, False, False, True, True],
        "exec": [False, False, False, False, True, False],
        "put": [False, False, False, False, True, False],
    }


def test_an_upload_stream_that_cannot_rewind_is_not_retried() -> None:
    from sandpool.client.calls import Timeouts, put_file
    from sandpool.client.transport import may_retry

    class OneShot(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return False

    stream = io.BytesIO(b"abcdef")
    stream.seek(2)
    call = put_file(Timeouts(), "s", "a", stream)
    stream.read()
    assert may_retry(call, ConnectionFailed("x")) and stream.tell() == 2  # rewound to where it started
    assert not may_retry(put_file(Timeouts(), "s", "a", OneShot()), ConnectionFailed("x"))  # type: ignore[arg-type]  # a stream without seek, on purpose
