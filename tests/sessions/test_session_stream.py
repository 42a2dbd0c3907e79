"""A streamed Execute through the api: relayed as it comes, checked, metered before the result,
cancel, disconnects; and agents that break the event format (docs/api.md, "Streaming")."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import httpx
import pytest
from sessions_harness import ServedApp, publish
from sse_events import CANCEL_HEADERS, STREAM_HEADERS, collect, events, result_of, text_of
from testkit import usage_settled

from sandpool.contract import tenancy
from sandpool.sessions.stream import MAX_EVENT_BYTES, AgentEvents, MalformedStream


def code(source: str) -> dict[str, Any]:
    return {"tool": "code_execution", "input": {"code": source}}


@pytest.fixture
def session(api, agents, r, keys):
    """A standalone api, one real agent leased as a session: (client, session path, agent)."""
    app = api()
    (agent,) = agents.start(1)
    publish(r, keys, address=agent.address, secret=agent.secret)
    with httpx.Client(base_url=app.url, timeout=60) as client:
        sid = client.post("/sessions", json={}).json()["session_id"]
        yield client, f"/sessions/{sid}", agent


def executions(r, keys) -> int:
    return int(r.hget(keys.usage_total(tenancy.STANDALONE_WORKSPACE), "executions") or 0)


def test_events_are_relayed_and_the_call_metered_before_its_result(session, r, keys) -> None:
    client, base, agent = session
    metered_when_result_arrived: list[int] = []

    def on_event(event: tuple[str, Any]) -> None:
        if event[0] == "result":
            metered_when_result_arrived.append(executions(r, keys))

    source = ("import sys, time\nfor i in range(5):\n    print(i, flush=True); time.sleep(0.1)\n"
              "print('!', file=sys.stderr)")
    with client.stream("POST", base + "/exec", json=code(source), headers=STREAM_HEADERS) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert "x-sandpool-outcome" not in resp.headers
        got = collect(resp.iter_lines(), on_event)
    assert metered_when_result_arrived == [1], "the result reached the client before its call was metered"
    assert not [value for kind, value in got if kind == "comment" and value.startswith("outcome")]  # consumed
    content = result_of(got)["result_block"]["content"]
    assert text_of(got, "stdout") == content["stdout"] == "0\n1\n2\n3\n4\n"
    assert text_of(got, "stderr") == content["stderr"] == "!\n"
    assert len([kind for kind, _ in got if kind == "stdout"]) >= 2
    # The plain Execute is what it always was.
    plain = client.post(base + "/exec", json=code("print('plain')"))
    assert plain.headers["content-type"] == "application/json"
    assert plain.json()["result_block"]["content"]["stdout"] == "plain\n"
    usage_settled(lambda: executions(r, keys), int, 2)  # a plain Execute is metered just after its answer


def test_cancel_through_the_api(session) -> None:
    client, base, agent = session
    assert client.post(base + "/exec", json=code("state = 'kept'")).status_code == 200
    answers: list[httpx.Response] = []

    def cancel(event: tuple[str, Any]) -> None:
        if event[0] == "stdout" and not answers:
            answers.append(client.delete(base + "/exec"))

    forever = "import sys, time\nsys.stdout.write('go\\n'); sys.stdout.flush()\nwhile True: time.sleep(0.05)"
    with client.stream("POST", base + "/exec", headers=STREAM_HEADERS, json=code(forever)) as resp:
        got = collect(resp.iter_lines(), cancel)
    assert [a.status_code for a in answers] == [200] and answers[0].json()["call_id"]
    assert result_of(got)["cancelled"] is True
    assert client.post(base + "/exec", json=code("print(state)")).json()["result_block"]["content"]["stdout"] \
        == "kept\n"
    idle = client.delete(base + "/exec")
    assert idle.status_code == 409 and idle.json()["reason"] == "no_running_call"
    assert client.delete("/sessions/unknown-session/exec").status_code == 404


def test_a_client_that_leaves_stops_nothing_and_the_call_is_still_metered(session, r, keys) -> None:
    client, base, agent = session
    source = ("import sys, time\nsys.stdout.write('started\\n'); sys.stdout.flush()\ntime.sleep(1)\n"
              "open('done.marker', 'w').write('x')")
    with client.stream("POST", base + "/exec", json=code(source), headers=STREAM_HEADERS) as resp:
        assert next(e for e in events(resp.iter_lines()) if e[0] != "comment") == ("stdout", "started\n")
    usage_settled(lambda: executions(r, keys), int, 1, timeout=30, what="the abandoned call's metering")
    assert (agent.workspace / "done.marker").read_text() == "x"


def test_a_client_that_leaves_with_the_cancel_header_stops_the_call(session, r, keys) -> None:
    client, base, agent = session
    source = ("import time\nvalue = 3\nimport sys; sys.stdout.write('started\\n'); sys.stdout.flush()\n"
              "time.sleep(100)\nopen('never.marker', 'w').write('x')")
    with client.stream("POST", base + "/exec", json=code(source), headers=CANCEL_HEADERS) as resp:
        assert next(e for e in events(resp.iter_lines()) if e[0] != "comment") == ("stdout", "started\n")
    after = client.post(base + "/exec", json=code("print(value)"))
    assert after.json()["result_block"]["content"]["stdout"] == "3\n"
    assert not (agent.workspace / "never.marker").exists()
    usage_settled(lambda: executions(r, keys), int, 2)  # the cancelled call ran and is metered too


def test_a_queued_call_whose_client_leaves_is_withdrawn_and_the_running_one_untouched(session, r, keys) -> None:
    """Call A (streamed, no cancel header) runs; call B (streamed, with it) waits behind A; B's client
    leaves. B is withdrawn and never runs; A runs to its end; only A is metered."""
    client, base, agent = session
    a_source = ("import sys, time\nsys.stdout.write('a started\\n'); sys.stdout.flush()\n"
                "while not __import__('os').path.exists('release.marker'): time.sleep(0.05)\nprint('a done')")
    b_source = "open('b-ran.marker', 'w').write('x')"
    with httpx.Client(base_url=str(client.base_url), timeout=60) as a_client, \
            a_client.stream("POST", base + "/exec", json=code(a_source), headers=STREAM_HEADERS) as a:
        a_lines = a.iter_lines()
        assert next(e for e in events(a_lines) if e[0] != "comment") == ("stdout", "a started\n")
        with httpx.Client(base_url=str(client.base_url), timeout=60) as b_client:
            with b_client.stream("POST", base + "/exec", json=code(b_source), headers=CANCEL_HEADERS) as b:
                assert b.status_code == 200  # its stream started; the call waits for its turn behind A
            # B's client is gone: the api withdraws B by its call id.
        (agent.workspace / "release.marker").write_text("go")
        rest = collect(a_lines, lambda _: None)
    assert result_of(rest)["result_block"]["content"]["stdout"] == "a started\na done\n"
    assert "cancelled" not in result_of(rest)
    assert client.post(base + "/exec", json=code("print('after')")).json()["result_block"]["content"]["stdout"] \
        == "after\n"
    assert not (agent.workspace / "b-ran.marker").exists()
    # A and the call after it (metered just after its answer); B never ran and is not metered.
    usage_settled(lambda: executions(r, keys), int, 2, what="A and the last call metered")


# --- agents that break the format ----------------------------------------------------------------------


def hostile_agent(chunks: Callable[[], Iterable[bytes]]) -> Callable[..., Awaitable[None]]:
    """An 'agent' answering every exec with a 200 event stream made of `chunks`."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
        for chunk in chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def endless_line() -> Iterable[bytes]:
    yield b"event: stdout\ndata: {\"text\":\""
    for _ in range(4096):  # 256 MiB offered, never terminated
        yield b"A" * 65536


@pytest.mark.parametrize("chunks", [
    lambda: [b"event: stdout\ndata: not json\n\n"],
    lambda: [b"event: stdout\ndata: {\"text\":\"a\"}\r\n\r\n"],
    lambda: [b"event: surprise\ndata: {}\n\n"],
    lambda: [b"event: stdout\ndata: {\"text\":\"cut short\"}\n\n"],  # no result
    endless_line,
], ids=["not-json", "carriage-returns", "unknown-event", "no-result", "endless-event"])
def test_a_broken_stream_ends_as_a_failed_sandbox(api, r, keys, chunks) -> None:
    agent = ServedApp(hostile_agent(chunks)).start()
    try:
        app = api()
        publish(r, keys, address=agent.url, secret="s")
        with httpx.Client(base_url=app.url, timeout=60) as client:
            sid = client.post("/sessions", json={}).json()["session_id"]
            with client.stream("POST", f"/sessions/{sid}/exec", json=code("x"), headers=STREAM_HEADERS) as resp:
                got = collect(resp.iter_lines())
            assert got[-1][0] == "error"
            assert got[-1][1]["status"] == 502 and got[-1][1]["reason"] == "sandbox_failed"
            assert [kind for kind, _ in got if kind not in ("stdout", "error")] == []
            assert client.get(f"/sessions/{sid}").status_code == 404  # released as a dead sandbox
    finally:
        agent.stop()


def test_the_parser_takes_only_what_the_agent_sends() -> None:
    parser = AgentEvents()
    got = parser.feed(b": heartbeat\n\nevent: stdout\ndata: {\"text\":\"a\\n\"}\n\n: outcome ok\n\nevent: res")
    assert [(kind, value) for kind, value, _ in got] == [("heartbeat", None), ("stdout", {"text": "a\n"}),
                                                        ("outcome", "ok")]
    assert got[1][2] == b"event: stdout\ndata: {\"text\":\"a\\n\"}\n\n"  # relayed as the agent wrote it
    assert parser.pending
    (result,) = parser.feed(b"ult\ndata: {\"tool_use_id\":\"t\"}\n\n")
    assert result[:2] == ("result", {"tool_use_id": "t"}) and not parser.pending
    for bad in (b"data: {}\n\n", b"event: stdout\ndata: {}\n\n", b"event: error\ndata: {\"status\":502}\n\n",
                b"event: stdout\ndata: {\"text\":1}\n\n", b"event: stdout\ndata: []\n\n",
                b"event: stdout\ndata: {\"text\":\"\xff\"}\n\n", b"event: stdout\nid: 1\ndata: {\"text\":\"\"}\n\n"):
        with pytest.raises(MalformedStream):
            AgentEvents().feed(bad)
    with pytest.raises(MalformedStream):
        AgentEvents().feed(b"event: stdout\ndata: \"" + b"a" * MAX_EVENT_BYTES)
    # A result may be larger than an output event (it holds both streams), still within its own bound.
    big = b"event: result\ndata: {\"x\":\"" + b"a" * (2 * MAX_EVENT_BYTES) + b"\"}\n\n"
    assert AgentEvents().feed(big)[0][0] == "result"


def test_a_flood_of_output_streams_no_more_than_the_cap(session) -> None:
    """64 MiB printed as fast as the program can: the stream carries the kept 1 MiB per stream and the
    marker, like the result, so nothing between the sandbox and the client holds more than that."""
    client, base, agent = session
    flood = ("import os\nchunk = b'x' * (1 << 20)\n"
             "for _ in range(64):\n    os.write(1, chunk); os.write(2, chunk)\n")
    received = 0
    with client.stream("POST", base + "/exec", json=code(flood), headers=STREAM_HEADERS) as resp:
        lines = []
        for line in resp.iter_lines():
            received += len(line) + 1
            lines.append(line)
    got = collect(lines)
    content = result_of(got)["result_block"]["content"]
    assert text_of(got, "stdout") == content["stdout"] and text_of(got, "stderr") == content["stderr"]
    assert content["stdout"].endswith(f"[sandpool: output truncated: {63 << 20} more bytes discarded]\n")
    # Each stream's 1 MiB twice (its events and the result), plus framing.
    assert received < 4 * (1 << 20) + 256 * 1024


def test_another_workspace_can_neither_stream_from_nor_cancel_a_session(tenant_api, agents, r, keys) -> None:
    app = tenant_api()
    (agent,) = agents.start(1)
    publish(r, keys, address=agent.address, secret=agent.secret)
    with httpx.Client(base_url=app.url, timeout=60) as client:
        owner, intruder = app.headers("owner"), app.headers("intruder")
        sid = client.post("/sessions", json={}, headers=owner).json()["session_id"]
        base = f"/sessions/{sid}"
        answers: list[httpx.Response] = []

        def probe(event: tuple[str, Any]) -> None:
            if event[0] == "stdout" and not answers:
                answers.append(client.delete(base + "/exec", headers=intruder))
                answers.append(client.post(base + "/exec", json=code("print(1)"),
                                           headers={**intruder, **STREAM_HEADERS}))

        source = "import sys, time\nsys.stdout.write('go\\n'); sys.stdout.flush()\ntime.sleep(0.5)\nprint('end')"
        with client.stream("POST", base + "/exec", json=code(source), headers={**owner, **STREAM_HEADERS}) as resp:
            got = collect(resp.iter_lines(), probe)
        assert [a.status_code for a in answers] == [404, 404]
        assert answers[0].json() == answers[1].json() == {"detail": "session not found", "reason": "not_found"}
        assert "cancelled" not in result_of(got) and text_of(got, "stdout") == "go\nend\n"
