"""A streamed Execute straight at a real agent: events as the program writes, the exact result last,
the output cap applied alike, cancel and disconnects (docs/api.md, "Streaming")."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_harness import Agent, S, start_agent
from sse_events import CANCEL_HEADERS, STREAM_HEADERS, collect, events, result_of, text_of
from testkit import wait_for

CODE = "code_execution"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    a = start_agent(tmp_path_factory.mktemp("stream"), "--interrupt-grace-seconds", "1",
                    "--stream-heartbeat-seconds", "0.2", "--max-output-bytes", "4096")
    yield a
    a.stop()


def body(code: str, tool: str = CODE, **extra: Any) -> dict[str, Any]:
    field = {"code_execution": "code", "bash_code_execution": "command"}[tool]
    return {"tool": tool, "input": {field: code}, **extra}


def stream(agent: Agent, code: str, *, headers: dict[str, str] = STREAM_HEADERS, tool: str = CODE,
           on_event: Any = None, **extra: Any) -> list[tuple[str, Any]]:
    with agent.client.stream("POST", f"{S}/exec", json=body(code, tool, **extra), headers=headers) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return collect(resp.iter_lines(), on_event)


def test_lines_arrive_as_printed_before_the_program_ends(agent: Agent) -> None:
    marker = agent.workspace / "ended.marker"
    code = ("import time\n"
            "for i in range(10):\n"
            "    print(f'line {i}', flush=True)\n"
            "    time.sleep(0.2)\n"
            "open('ended.marker', 'w').write('done')\n")
    seen_before_end: list[bool] = []

    def on_event(event: tuple[str, Any]) -> None:
        if event[0] == "stdout" and not seen_before_end:
            seen_before_end.append(not marker.exists())

    got = stream(agent, code, on_event=on_event)
    assert seen_before_end == [True], "the first line reached the reader only after the program had ended"
    outputs = [value for kind, value in got if kind == "stdout"]
    assert len(outputs) >= 2, "ten lines over two seconds came as one event: nothing was streamed"
    assert text_of(got, "stdout") == "".join(f"line {i}\n" for i in range(10))
    result = result_of(got)
    assert result["result_block"]["content"]["stdout"] == text_of(got, "stdout")
    assert ("comment", "outcome ok") in got  # the scheduler's metering reads it just before the result
    assert got[-2] == ("comment", "outcome ok")
    assert marker.exists()


def test_the_stream_is_the_result_cut_at_the_cap(agent: Agent) -> None:
    code = ("import sys\n"
            "for i in range(400):\n"
            "    print(f'out {i:04d} ' + 'x' * 30, flush=True)\n"
            "sys.stderr.write('e' * 5000)\n")
    got = stream(agent, code)
    content = result_of(got)["result_block"]["content"]
    assert text_of(got, "stdout") == content["stdout"]
    assert text_of(got, "stderr") == content["stderr"]
    assert "[sandpool: output truncated:" in content["stdout"]
    assert "[sandpool: output truncated: 904 more bytes discarded]" in content["stderr"]
    assert result_of(got)["limit_exceeded"] == "output"
    kept = content["stdout"].split("\n[sandpool:")[0]
    assert len(kept.encode()) == 4096


def test_each_stream_keeps_its_order_and_bytes_decode_as_in_the_result(agent: Agent) -> None:
    code = ("import sys, time\n"
            "for i in range(30):\n"
            "    print(f'o{i}', flush=True)\n"
            "    print(f'e{i}', file=sys.stderr, flush=True)\n"
            "    if i % 10 == 0: time.sleep(0.05)\n"
            "out = sys.stdout.buffer\n"
            "out.write('é€'.encode()[:3]); out.flush(); time.sleep(0.05)\n"  # a character cut between writes
            "out.write('é€'.encode()[3:] + b'\\xff!\\n'); out.flush()\n")
    got = stream(agent, code)
    content = result_of(got)["result_block"]["content"]
    assert text_of(got, "stdout") == content["stdout"] == "".join(f"o{i}\n" for i in range(30)) + "é€\ufffd!\n"
    assert text_of(got, "stderr") == content["stderr"] == "".join(f"e{i}\n" for i in range(30))


def test_bash_streams_and_heartbeats_while_silent(agent: Agent) -> None:
    got = stream(agent, "echo first; sleep 1; echo second >&2", tool="bash_code_execution")
    kinds = [kind for kind, _ in got]
    first, second = kinds.index("stdout"), kinds.index("stderr")
    assert ("comment", "heartbeat") in got[first:second], "no heartbeat in a silent second (0.2 s interval)"
    assert result_of(got)["result_block"]["content"] == {
        "type": "code_execution_result", "stdout": "first\n", "stderr": "second\n", "return_code": 0, "content": []}


def test_the_editor_and_refusals_answer_plain_json(agent: Agent) -> None:
    edit = agent.client.post(f"{S}/exec", headers=STREAM_HEADERS, json={
        "tool": "text_editor_code_execution", "input": {"command": "create", "path": "s.txt", "file_text": "a"}})
    assert edit.status_code == 200 and edit.headers["content-type"] == "application/json"
    assert edit.json()["result_block"]["type"] == "text_editor_code_execution_tool_result"
    bad = agent.client.post(f"{S}/exec", headers=STREAM_HEADERS, json={"tool": CODE, "input": {}})
    assert bad.status_code == 422 and bad.json()["reason"] == "invalid_request"
    unknown = agent.client.post(f"{S}/exec", headers=STREAM_HEADERS, json={"tool": "nope", "input": {}})
    assert unknown.status_code == 400


def test_cancel_interrupts_the_running_call_and_keeps_state(agent: Agent) -> None:
    assert agent.py("kept = 'still here'")["result_block"]["content"]["return_code"] == 0
    answers: list[Any] = []

    def cancel_on_first_output(event: tuple[str, Any]) -> None:
        if event[0] == "stdout" and not answers:
            answers.append(agent.new_client(agent.secret).delete(f"{S}/exec"))

    got = stream(agent, "import sys, time\nsys.stdout.write('working\\n'); sys.stdout.flush()\n"
                        "while True: time.sleep(0.05)\n", on_event=cancel_on_first_output)
    assert [a.status_code for a in answers] == [200] and answers[0].json()["call_id"]  # names what it stopped
    result = result_of(got)
    assert result["cancelled"] is True
    content = result["result_block"]["content"]
    assert content["return_code"] == 130
    assert content["stderr"].endswith("[sandpool: cancelled: the call was interrupted]\n")
    assert text_of(got, "stderr") == content["stderr"]
    assert got[-2] == ("comment", "outcome cancelled")
    assert agent.py("print(kept)")["result_block"]["content"]["stdout"] == "still here\n"


def test_cancel_with_nothing_running_is_a_clear_409(agent: Agent) -> None:
    answer = agent.client.delete(f"{S}/exec")
    assert answer.status_code == 409
    assert answer.json()["reason"] == "no_running_call"
    assert agent.new_client(None).delete(f"{S}/exec").status_code == 401  # the secret, as every call


def test_cancel_does_not_wait_behind_the_call_it_stops(agent: Agent) -> None:
    """A plain (non-streamed) call is cancelled from another connection while it holds the session."""
    holder: list[dict[str, Any]] = []
    thread = threading.Thread(target=lambda: holder.append(agent.py("import time\ntime.sleep(120)")))
    thread.start()
    wait_for(lambda: agent.new_client(agent.secret).delete(f"{S}/exec").status_code == 200,
             timeout=30, what="the sleeping call to be cancelled")
    thread.join(60)
    assert holder and holder[0]["cancelled"] is True


def test_a_reader_that_leaves_stops_nothing(agent: Agent) -> None:
    marker = agent.workspace / "left-alone.marker"
    code = ("import time\nimport sys; sys.stdout.write('started\\n'); sys.stdout.flush()\n"
            "time.sleep(1)\nopen('left-alone.marker', 'w').write('finished')\nlater = 7\n")
    with agent.client.stream("POST", f"{S}/exec", json=body(code), headers=STREAM_HEADERS) as resp:
        first = next(e for e in events(resp.iter_lines()) if e[0] != "comment")
    assert first == ("stdout", "started\n")
    assert agent.py("print(later)")["result_block"]["content"]["stdout"] == "7\n"  # queued behind it, in order
    assert marker.read_text() == "finished"


def test_a_reader_that_leaves_with_the_cancel_header_stops_the_call(agent: Agent) -> None:
    marker = agent.workspace / "cancelled.marker"
    code = ("import time\nbefore = 'kept'\nimport sys; sys.stdout.write('started\\n'); sys.stdout.flush()\n"
            "time.sleep(100)\nopen('cancelled.marker', 'w').write('not stopped')\n")
    with agent.client.stream("POST", f"{S}/exec", json=body(code), headers=CANCEL_HEADERS) as resp:
        first = next(e for e in events(resp.iter_lines()) if e[0] != "comment")
    assert first == ("stdout", "started\n")
    after = agent.py("print(before)")["result_block"]["content"]
    assert after["stdout"] == "kept\n"
    assert not Path(marker).exists()


def test_a_timeout_ends_the_stream_as_it_ends_the_result(agent: Agent) -> None:
    got = stream(agent, "import time\nprint('before', flush=True)\nwhile True: time.sleep(0.05)", timeout_seconds=1)
    result = result_of(got)
    content = result["result_block"]["content"]
    assert result["limit_exceeded"] == "timeout" and content["return_code"] == 124
    assert text_of(got, "stdout") == content["stdout"] == "before\n"
    assert text_of(got, "stderr") == content["stderr"]
    assert content["stderr"].endswith("[sandpool: timeout: execution exceeded the 1s limit and was interrupted]\n")
    assert got[-2] == ("comment", "outcome timeout")


def test_a_cancel_names_its_call_a_waiting_one_is_withdrawn_and_the_running_one_untouched(agent: Agent) -> None:
    """Call A runs; call B waits behind it. A cancel naming B withdraws B (it never runs, its stream ends
    `cancelled`); A runs on to its end. A cancel naming a call that neither runs nor waits is a 409."""
    release, ran = agent.workspace / "release-a.marker", agent.workspace / "b-ran.marker"
    started = agent.workspace / "a-started.marker"
    a_code = ("import os, time\nopen('a-started.marker', 'w').write('x')\n"
              "while not os.path.exists('release-a.marker'): time.sleep(0.02)\nprint('a done')")
    a_result: list[dict[str, Any]] = []
    a = threading.Thread(target=lambda: a_result.append(agent.client.post(
        f"{S}/exec", json=body(a_code), headers={"Sandpool-Call-Id": "call-a"}).json()))
    a.start()
    wait_for(started.exists, timeout=30, what="A running")
    nobody = agent.new_client(agent.secret).delete(f"{S}/exec?call_id=nobody")
    assert nobody.status_code == 409 and nobody.json()["reason"] == "no_running_call"
    b_events: list[list[tuple[str, Any]]] = []
    b = threading.Thread(target=lambda: b_events.append(stream(
        agent, "open('b-ran.marker', 'w').write('x')", headers={**STREAM_HEADERS, "Sandpool-Call-Id": "call-b"})))
    b.start()
    withdrawn = wait_for(lambda: (r := agent.new_client(agent.secret).delete(
        f"{S}/exec?call_id=call-b")).status_code == 200 and r, timeout=30, what="B withdrawn")
    assert withdrawn.json() == {"call_id": "call-b"}
    b.join(30)
    result = result_of(b_events[0])
    assert result["cancelled"] is True and result["result_block"]["content"]["return_code"] == 130
    assert ("comment", "outcome withdrawn") in b_events[0]
    release.write_text("go")
    a.join(30)
    assert a_result[0]["result_block"]["content"]["stdout"] == "a done\n" and "cancelled" not in a_result[0]
    assert not ran.exists()
    release.unlink()
    started.unlink()
