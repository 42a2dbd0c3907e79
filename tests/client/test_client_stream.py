"""Streamed Execute in the client: callbacks, iterators, cancel, leaving early; against a scripted server
(what the wire may carry) and the live `sandpool up --no-auth` stack (what sandpool sends)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from client_scripted import Reply, ScriptedServer, ok_exec_body
from client_stack import Stack

from sandpool.client import AsyncClient, Client, ExecEvent, ProtocolError, SandboxFailed, Unavailable

pytestmark = pytest.mark.timeout(60)
RETRIES = {"max_retries": 20, "max_retry_wait": 30.0}
EXEC = ("POST", "/sessions/s-1/exec")


def sse(*events: tuple[str, object], comments: tuple[str, ...] = (": heartbeat",)) -> Reply:
    wire = "".join(c + "\n\n" for c in comments)
    wire += "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)
    return Reply(200, raw=wire.encode(), headers={"content-type": "text/event-stream; charset=utf-8"})


# --- the wire, scripted ------------------------------------------------------------------------------


def test_callbacks_get_each_piece_and_the_result_comes_back(scripted: ScriptedServer) -> None:
    scripted.script(*EXEC, sse(("stdout", {"text": "a\n"}), ("stderr", {"text": "warn\n"}),
                               ("stdout", {"text": "b\n"}), ("result", ok_exec_body("a\nb\n"))))
    out: list[str] = []
    err: list[str] = []
    with Client(scripted.url, token="tok") as client:
        result = client.attach("s-1").run_code("print('a')", on_stdout=out.append, on_stderr=err.append)
    assert out == ["a\n", "b\n"] and err == ["warn\n"]
    assert result.stdout == "a\nb\n" and result.ok
    (seen,) = scripted.hits(*EXEC)
    assert seen.headers["accept"] == "text/event-stream"
    assert "sandpool-cancel-on-disconnect" not in seen.headers
    assert json.loads(seen.body) == {"tool": "code_execution", "input": {"code": "print('a')"}}


def test_the_iterator_ends_with_the_result_and_asks_for_cancel_on_disconnect(scripted: ScriptedServer) -> None:
    scripted.script(*EXEC, sse(("stdout", {"text": "x"}), ("future_event", {"n": 1}),
                               ("result", ok_exec_body("x", cancelled=True))))
    with Client(scripted.url) as client:
        got = list(client.attach("s-1").stream_bash("echo x", cancel_on_disconnect=True))
    assert [e.type for e in got] == ["stdout", "result"]  # an unknown event is skipped
    assert got[0] == ExecEvent("stdout", text="x")
    assert got[-1].result is not None and got[-1].result.cancelled and not got[-1].result.ok
    (seen,) = scripted.hits(*EXEC)
    assert seen.headers["sandpool-cancel-on-disconnect"] == "true"
    assert json.loads(seen.body)["tool"] == "bash_code_execution"


def test_a_backend_without_streaming_answers_json_and_reads_the_same(scripted: ScriptedServer) -> None:
    scripted.script(*EXEC, Reply(200, ok_exec_body("whole\n")))
    pieces: list[str] = []
    with Client(scripted.url) as client:
        result = client.attach("s-1").run_python("print('whole')", on_stdout=pieces.append)
        scripted.script(*EXEC, Reply(200, ok_exec_body("whole\n")))
        kinds = [e.type for e in client.attach("s-1").stream_code("print('whole')")]
    assert pieces == ["whole\n"] and result.stdout == "whole\n"
    assert kinds == ["stdout", "result"]


def test_errors_in_and_around_the_stream(scripted: ScriptedServer) -> None:
    with Client(scripted.url, max_retries=0) as client:
        s = client.attach("s-1")
        scripted.script(*EXEC, sse(("stdout", {"text": "a"}), ("error", {"status": 502, "reason": "sandbox_failed",
                                                                          "detail": "gone"})))
        with pytest.raises(SandboxFailed) as failed:
            list(s.stream_code("x"))
        assert failed.value.request_id and failed.value.status == 502
        scripted.script(*EXEC, Reply(503, {"detail": "busy", "reason": "unavailable"}, {"Retry-After": "1"}))
        with pytest.raises(Unavailable):
            s.run_code("x", on_stdout=print)
        scripted.script(*EXEC, sse(("stdout", {"text": "cut"})))
        with pytest.raises(ProtocolError, match="before its result"):
            list(s.stream_code("x"))
        scripted.script(*EXEC, Reply(200, raw=b"event: stdout\ndata: {oops\n\n",
                                     headers={"content-type": "text/event-stream"}))
        with pytest.raises(ProtocolError):
            list(s.stream_code("x"))


def test_cancel_says_whether_a_call_was_stopped(scripted: ScriptedServer) -> None:
    scripted.script("DELETE", "/sessions/s-1/exec", Reply(204),
                    Reply(409, {"detail": "none", "reason": "no_running_call"}))
    with Client(scripted.url) as client:
        s = client.attach("s-1")
        assert s.cancel() is True
        assert s.cancel() is False


def test_the_async_client_streams_too(scripted: ScriptedServer) -> None:
    scripted.script(*EXEC, sse(("stdout", {"text": "1"}), ("stdout", {"text": "2"}), ("result", ok_exec_body("12"))),
                    sse(("stderr", {"text": "e"}), ("result", ok_exec_body(""))))
    scripted.script("DELETE", "/sessions/s-1/exec", Reply(204))

    async def main() -> tuple[list[str], list[str], str, bool]:
        async with AsyncClient(scripted.url) as client:
            s = client.attach("s-1")
            out: list[str] = []
            result = await s.run_code("x", on_stdout=out.append)
            kinds = [e.type async for e in s.stream_bash("y")]
            return out, kinds, result.stdout, await s.cancel()

    out, kinds, stdout, cancelled = asyncio.run(main())
    assert out == ["1", "2"] and stdout == "12" and kinds == ["stderr", "result"] and cancelled


# Line ends by the specification are CR, LF and CRLF only; these three are line ends to str.splitlines()
# and so to httpx's iter_lines(), which split an event's JSON data in two.
UNICODE_LINE_ENDS = ("a\u2028b", "c\u2029d", "e\u0085f")
MULTIBYTE = ("price: 5\u20ac", "snake \U0001f40d\n")  # 3 and 4 bytes of UTF-8


def cut_inside_characters(wire: str) -> list[bytes]:
    """The wire as separate writes, cut after the first byte of each non-ASCII character and between each
    CR and its LF, so a character and a CRLF reach the client in two network reads."""
    chunks, current = [], b""
    for i, ch in enumerate(wire):
        encoded = ch.encode()
        if len(encoded) > 1:
            chunks.append(current + encoded[:1])
            current = encoded[1:]
        elif ch == "\r" and wire[i + 1:i + 2] == "\n":
            chunks.append(current + encoded)
            current = b""
        else:
            current += encoded
    return [*chunks, current]


def split_stream() -> tuple[Reply, list[str]]:
    """A stream whose output holds Unicode line ends and multibyte characters, each cut across writes, with
    one event's lines ended by CRLF; and the pieces of output it carries."""
    texts = [*UNICODE_LINE_ENDS, *MULTIBYTE]
    wire = ": heartbeat\r\n\r\n"
    for text in texts:
        wire += f"event: stdout\ndata: {json.dumps({'text': text}, ensure_ascii=False)}\n\n"
    wire += f"event: result\r\ndata: {json.dumps(ok_exec_body(''.join(texts)), ensure_ascii=False)}\r\n\r\n"
    chunks = cut_inside_characters(wire)
    assert len(chunks) > 2 * len(texts)  # (every character above really is cut)
    return Reply(200, chunks=chunks, headers={"content-type": "text/event-stream; charset=utf-8"}), texts


def test_output_with_unicode_line_ends_and_split_characters_reads_whole(scripted: ScriptedServer) -> None:
    reply, texts = split_stream()
    scripted.script(*EXEC, reply, reply)
    pieces: list[str] = []
    with Client(scripted.url) as client:
        s = client.attach("s-1")
        result = s.run_code("print('a\u2028b')", on_stdout=pieces.append)
        events = list(s.stream_code("x"))
    assert pieces == texts and result.stdout == "".join(texts)
    assert [e.text for e in events if e.type == "stdout"] == texts
    assert events[-1].result is not None and events[-1].result.stdout == "".join(texts)


def test_an_event_stream_is_utf_8_whatever_charset_its_header_names(scripted: ScriptedServer) -> None:
    wire = sse(("stdout", {"text": "\u20ac"}), ("result", ok_exec_body("\u20ac")))
    assert wire.raw is not None
    scripted.script(*EXEC, Reply(200, raw=wire.raw.replace(b"\\u20ac", "\u20ac".encode()),
                                 headers={"content-type": "text/event-stream; charset=iso-8859-1"}))
    with Client(scripted.url) as client:
        pieces = [e.text for e in client.attach("s-1").stream_code("x") if e.type == "stdout"]
    assert pieces == ["\u20ac"]


def test_the_async_client_reads_unicode_line_ends_and_split_characters_whole(scripted: ScriptedServer) -> None:
    reply, texts = split_stream()
    scripted.script(*EXEC, reply, reply)

    async def main() -> tuple[list[str], str, list[ExecEvent]]:
        async with AsyncClient(scripted.url) as client:
            s = client.attach("s-1")
            pieces: list[str] = []
            result = await s.run_code("print('a\u2028b')", on_stdout=pieces.append)
            return pieces, result.stdout, [e async for e in s.stream_code("x")]

    pieces, stdout, events = asyncio.run(main())
    assert pieces == texts and stdout == "".join(texts)
    assert [e.text for e in events if e.type == "stdout"] == texts
    assert events[-1].result is not None and events[-1].result.stdout == "".join(texts)


# --- the live stack --------------------------------------------------------------------------------


@pytest.fixture
def client(stack: Stack) -> Iterator[Client]:
    with Client(stack.url, stack.token, **RETRIES) as c:  # type: ignore[arg-type]
        yield c


LINES = "import time\nfor i in range(6):\n    print(f'line {i}', flush=True)\n    time.sleep(0.2)\n"


def test_live_output_comes_in_pieces_that_make_the_result(client: Client) -> None:
    with client.session() as s:
        pieces: list[str] = []
        result = s.run_code(LINES, on_stdout=pieces.append)
        assert "".join(pieces) == result.stdout == "".join(f"line {i}\n" for i in range(6))
        assert len(pieces) >= 2, "six lines over a second came as one piece: nothing was streamed"
        events = list(s.stream_bash("echo out; echo err >&2; exit 3"))
        assert events[-1].result is not None and events[-1].result.return_code == 3
        assert "".join(e.text for e in events if e.type == "stderr") == events[-1].result.stderr


def test_live_cancel_and_leaving_early(client: Client) -> None:
    with client.session() as s:
        s.run_code("kept = 1")
        assert s.cancel() is False
        first: list[str] = []

        def cancel_on_first(text: str) -> None:
            if not first:
                first.append(text)
                threading.Thread(target=s.cancel).start()

        stopped = s.run_code("import time\nprint('go', flush=True)\nwhile True: time.sleep(0.05)",
                             on_stdout=cancel_on_first)
        assert stopped.cancelled and stopped.return_code == 130 and not stopped.ok
        for event in s.stream_code("import time\nprint('go', flush=True)\ntime.sleep(100)\nkept = 2",
                                   cancel_on_disconnect=True):
            assert event.type == "stdout"
            break  # leaving the loop closes the connection: the server cancels the call
        assert s.run_code("print(kept)").stdout == "1\n"


def test_live_async_stream_and_cancel(stack: Stack) -> None:
    async def main() -> tuple[list[ExecEvent], bool, bool, str]:
        async with AsyncClient(stack.url, stack.token, **RETRIES) as client:  # type: ignore[arg-type]
            async with client.session() as s:
                events = [e async for e in s.stream_code("import sys\nprint('a')\nprint('b', file=sys.stderr)")]

                async def cancel_soon() -> bool:
                    for _ in range(600):  # False until the call below runs (polling the server)
                        if await s.cancel():
                            return True
                        await asyncio.sleep(0.05)
                    return False

                canceller = asyncio.ensure_future(cancel_soon())
                stopped = await s.run_code("import time\nwhile True: time.sleep(0.05)")
                after = await s.run_code("print('after')")
                return events, await canceller, stopped.cancelled, after.stdout

    events, cancelled, stopped_says_so, after = asyncio.run(main())
    # How the output is cut into events depends on timing (an unbuffered print is two writes); what
    # each stream's events add up to does not.
    assert {e.type for e in events[:-1]} == {"stdout", "stderr"} and events[-1].type == "result"
    assert "".join(e.text for e in events if e.type == "stdout") == "a\n"
    assert "".join(e.text for e in events if e.type == "stderr") == "b\n"
    assert cancelled and stopped_says_so and after == "after\n"
