"""Bounded capture of one output stream of one call.

A program may print gigabytes; the agent keeps at most `cap` bytes per stream
and only counts the rest, so its memory does not grow with the output. The
kept prefix is returned with a visible marker saying how much was dropped.
A streamed call also hands each kept piece to `listener` as it arrives, so the
stream carries exactly the bytes the result keeps (the cap applies to both).
"""

from __future__ import annotations

from collections.abc import Callable


class StreamCapture:
    def __init__(self, cap: int, listener: Callable[[bytes], None] | None = None) -> None:
        self.cap = cap
        self.listener = listener
        self._chunks: list[bytes] = []
        self._kept = 0
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        room = self.cap - self._kept
        if room > 0:
            kept = data[:room]
            self._chunks.append(kept)
            self._kept += len(kept)
            self.dropped += len(data) - len(kept)
            if self.listener is not None and kept:
                self.listener(kept)
        else:
            self.dropped += len(data)

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def text(self) -> str:
        out = b"".join(self._chunks).decode("utf-8", errors="replace")
        if self.dropped:
            out += f"\n[sandpool: output truncated: {self.dropped} more bytes discarded]\n"
        return out
