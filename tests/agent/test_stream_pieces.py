"""A streamed Execute's output pieces are at most 16 KiB of UTF-8 each, cut between characters
(docs/api.md, "Streaming"), against a real agent with the default 1 MiB output cap: a smaller cap
would never fill a piece."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from agent_harness import Agent, S
from sse_events import STREAM_HEADERS, collect, result_of

from sandpool.agent.streaming import OutputEvents, pieces

PIECE_BYTES = 16 * 1024
"""What docs/api.md promises per event."""

OUTPUTS = {
    "two-byte": "é" * 20000,
    "three-byte, off a piece's boundary": "ab" + "あ" * 12000,  # a character straddles each 16 KiB cut
    "four-byte": "x" + "😀" * 9000,
}


def streamed(agent: Agent, code: str) -> tuple[list[tuple[str, object]], dict[str, object]]:
    body = {"tool": "code_execution", "input": {"code": code}}
    with agent.client.stream("POST", f"{S}/exec", json=body, headers=STREAM_HEADERS) as resp:
        assert resp.status_code == 200
        got = collect(resp.iter_lines())
    return got, result_of(got)["result_block"]["content"]  # type: ignore[return-value]


def assert_pieces(got: list[tuple[str, object]], kind: str, expected: str) -> None:
    texts = [str(value) for k, value in got if k == kind]
    assert [len(t.encode()) for t in texts if len(t.encode()) > PIECE_BYTES] == [], "a piece over 16 KiB"
    assert "".join(texts) == expected


@pytest.mark.parametrize("text", OUTPUTS.values(), ids=OUTPUTS.keys())
def test_multibyte_output_is_sent_in_pieces_of_at_most_16_kib(agent: Agent, text: str) -> None:
    got, content = streamed(agent, f"import sys\ntext = {text!r}\nprint(text)\nprint(text, file=sys.stderr)")
    assert content["stdout"] == content["stderr"] == text + "\n"
    assert_pieces(got, "stdout", str(content["stdout"]))
    assert_pieces(got, "stderr", str(content["stderr"]))


def test_invalid_bytes_replaced_in_the_stream_still_fit_a_piece(agent: Agent) -> None:
    # Each invalid byte becomes U+FFFD, three bytes of UTF-8: 16 KiB read is 48 KiB of text.
    got, content = streamed(agent, "import sys\nsys.stdout.buffer.write(b'\\xff' * 20000); sys.stdout.flush()")
    assert content["stdout"] == "\ufffd" * 20000
    assert_pieces(got, "stdout", "\ufffd" * 20000)


def test_a_backlog_and_the_final_text_are_cut_alike() -> None:
    """Output sent at once (several decoded slices), then what the result adds at the end: the
    character cut at the cap and its marker, and a whole text (stderr) no reader saw."""
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    kept = ("ab" + "あ" * 30000).encode() + b"\xff" * 30000 + "😀".encode()[:2]
    stdout = kept.decode(errors="replace") + "\n[sandpool: output truncated: 2 more bytes discarded]\n"

    async def call() -> None:
        events = OutputEvents(send, heartbeat_seconds=60)
        events.on_output("stdout", kept)
        await events.finish(stdout, "é" * 20000, b"{}", "ok")

    asyncio.run(call())
    got = collect(b"".join(sent).decode().split("\n"))
    assert_pieces(got, "stdout", stdout)
    assert_pieces(got, "stderr", "é" * 20000)


def test_pieces_cut_only_between_characters_and_as_late_as_they_can() -> None:
    for text in ("", "a", "é" * 9000, "a" + "é" * 9000, "ab" + "あ" * 6000, "€😀" * 3000 + "z", "x" * PIECE_BYTES):
        cut = list(pieces(text))
        assert "".join(cut) == text
        assert all(0 < len(piece.encode()) <= PIECE_BYTES for piece in cut)
        assert all(len(piece.encode()) + len(after[0].encode()) > PIECE_BYTES
                   for piece, after in zip(cut, cut[1:], strict=False)), "a piece cut shorter than it could be"
