"""Reading a streamed Execute off the wire in tests: server-sent events as (kind, value) pairs.

Kinds: `stdout`/`stderr` (the text), `result`/`error` (the decoded JSON), and every comment as
`comment` (its text, e.g. "heartbeat" or "outcome ok"). Deliberately independent of the client's
own parser, so the tests check the wire format rather than one reading of it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

Event = tuple[str, Any]


def events(lines: Iterable[str]) -> Iterator[Event]:
    name, data = "", []
    for line in lines:
        if line == "":
            if data:
                body = json.loads("\n".join(data))
                yield (name, body["text"]) if name in ("stdout", "stderr") else (name, body)
            name, data = "", []
        elif line.startswith(":"):
            yield "comment", line[1:].strip()
        elif line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data.append(line[len("data: "):])
        else:
            raise AssertionError(f"not a server-sent events line: {line[:200]!r}")


def collect(lines: Iterable[str], on_event: Callable[[Event], None] | None = None) -> list[Event]:
    out = []
    for event in events(lines):
        if on_event is not None:
            on_event(event)
        out.append(event)
    return out


def text_of(stream: list[Event], kind: str) -> str:
    return "".join(value for k, value in stream if k == kind)


def result_of(stream: list[Event]) -> dict[str, Any]:
    results = [value for k, value in stream if k == "result"]
    assert len(results) == 1, f"expected one result event, got {[k for k, _ in stream]}"
    assert stream[-1][0] == "result", "the result event is the last one"
    return results[0]


STREAM_HEADERS = {"Accept": "text/event-stream"}
CANCEL_HEADERS = {**STREAM_HEADERS, "Sandpool-Cancel-On-Disconnect": "true"}
