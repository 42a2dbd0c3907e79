"""Streamed Execute end to end: `sandpool up` (the api with auth, the controller, isolated sandboxes), read off
the wire as `curl -N` reads it and with the Python client; cancel, disconnects, metering, auth."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sandbox_env import host_python
from sse_events import CANCEL_HEADERS, STREAM_HEADERS, collect, events, result_of, text_of
from testkit import usage_settled, wait_for
from up_harness import Up

from sandpool.client import Client

pytestmark = pytest.mark.timeout(180)


@dataclass
class Live:
    """One `sandpool up` (auth on) for the module, and what it printed."""

    stack: Up
    url: str
    token: str


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    stack = Up(data_dir=tmp_path_factory.mktemp("stream") / "data",
               env={"SANDPOOL_SANDBOX_PYTHON": host_python()})
    try:
        yield Live(stack, printed(stack, "SANDPOOL_URL="), printed(stack, "SANDPOOL_TOKEN="))
    finally:
        stack.cleanup()


def printed(stack: Up, prefix: str) -> str:
    """What follows `prefix` on the line `sandpool up` prints with it (once the pool is warm)."""

    def value() -> str | None:
        if stack.proc.poll() is not None:
            raise AssertionError(f"sandpool up exited: {stack.log_tail()}")
        return next((line[len(prefix):] for line in list(stack.lines) if line.startswith(prefix)), None)

    return wait_for(value, timeout=120, what=f"sandpool up to print {prefix}")


@pytest.fixture
def http(up: Live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=up.url, headers={"Authorization": f"Bearer {up.token}"}, timeout=60) as c:
        yield c


@pytest.fixture
def session(http: httpx.Client) -> Iterator[str]:
    created = http.post("/sessions", json={})
    assert created.status_code == 201, created.text
    sid = created.json()["session_id"]
    yield f"/sessions/{sid}"
    http.delete(f"/sessions/{sid}")


def code(source: str) -> dict[str, Any]:
    return {"tool": "code_execution", "input": {"code": source}}


def executions(http: httpx.Client) -> int:
    return int(http.get("/v1/usage").json()["total"].get("executions", 0))


def test_lines_reach_the_client_through_the_api_before_the_program_ends(http: httpx.Client, session: str) -> None:
    """The program's end marker is its last line, stamped with the (shared) host clock as it is written;
    the first line must have reached the client before that: an order of events, not a duration."""
    source = ("import time\n"
              "for i in range(10):\n"
              "    print(f'line {i}', flush=True)\n"
              "    time.sleep(0.2)\n"
              "print(f'end {time.time()!r}', flush=True)\n")
    first_arrival: list[float] = []

    def on_event(event: tuple[str, Any]) -> None:
        if event[0] == "stdout" and not first_arrival:
            first_arrival.append(time.time())

    with http.stream("POST", session + "/exec", json=code(source), headers=STREAM_HEADERS) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        got = collect(resp.iter_lines(), on_event)
    stdout = text_of(got, "stdout")
    ended_at = float(stdout.splitlines()[-1].split()[1])
    assert first_arrival[0] < ended_at, "the first line arrived only after the program had ended"
    assert len([kind for kind, _ in got if kind == "stdout"]) >= 2
    content = result_of(got)["result_block"]["content"]
    assert stdout == content["stdout"]
    assert stdout.startswith("".join(f"line {i}\n" for i in range(10)))
    assert not [value for kind, value in got if kind == "comment" and value.startswith("outcome")]


def test_auth_applies_to_streams_and_cancel(up: Live, session: str) -> None:
    with httpx.Client(base_url=up.url, timeout=30) as anonymous:
        refused = anonymous.post(session + "/exec", json=code("print(1)"), headers=STREAM_HEADERS)
        assert refused.status_code == 401 and refused.headers["content-type"] == "application/json"
        assert anonymous.delete(session + "/exec").status_code == 401


def test_cancel_and_disconnects_through_the_api(http: httpx.Client, session: str) -> None:
    before = executions(http)  # read before the plain Execute below, which is metered just after its answer
    assert http.post(session + "/exec", json=code("kept = 'yes'")).status_code == 200
    answers: list[int] = []

    def cancel(event: tuple[str, Any]) -> None:
        if event[0] == "stdout" and not answers:
            answers.append(http.delete(session + "/exec").status_code)

    with http.stream("POST", session + "/exec", headers=STREAM_HEADERS,
                     json=code("import time\nprint('go', flush=True)\nwhile True: time.sleep(0.05)")) as resp:
        got = collect(resp.iter_lines(), cancel)
    assert answers == [200] and result_of(got)["cancelled"] is True

    # Leaving without the header stops nothing: the call ends on its own and is metered.
    leave = "import sys, time\nsys.stdout.write('go\\n'); sys.stdout.flush()\ntime.sleep(0.5)\nleft = 'ran'"
    with http.stream("POST", session + "/exec", json=code(leave), headers=STREAM_HEADERS) as resp:
        assert next(e for e in events(resp.iter_lines()) if e[0] != "comment")[0] == "stdout"
    # Leaving with it cancels the call (it would otherwise sleep 100 s and then change `kept`).
    stop = "import sys, time\nsys.stdout.write('go\\n'); sys.stdout.flush()\ntime.sleep(100)\nkept = 'no'"
    with http.stream("POST", session + "/exec", json=code(stop), headers=CANCEL_HEADERS) as resp:
        assert next(e for e in events(resp.iter_lines()) if e[0] != "comment")[0] == "stdout"
    after = http.post(session + "/exec", json=code("print(kept, left)"))
    assert after.json()["result_block"]["content"]["stdout"] == "yes ran\n"
    usage_settled(lambda: executions(http), int, before + 5, timeout=30, what="every call metered, once")


def test_the_python_client_through_the_api(up: Live) -> None:
    with Client(up.url, up.token, max_retries=20) as client, client.session() as s:
        pieces: list[str] = []
        result = s.run_code("import time\nfor i in range(4):\n    print(i, flush=True); time.sleep(0.2)",
                            on_stdout=pieces.append)
        assert "".join(pieces) == result.stdout == "0\n1\n2\n3\n" and len(pieces) >= 2
        threading.Thread(target=lambda: wait_for(s.cancel, timeout=30, what="a running call")).start()
        stopped = list(s.stream_code("import time\nwhile True: time.sleep(0.05)"))
        assert stopped[-1].result is not None and stopped[-1].result.cancelled
