"""Counting the file bytes of a PutFile as it streams past, for metering.

Usage must be the api's own figure, never the sandbox's answer, and it must
be the file's bytes, not the multipart framing around them. The body is relayed
to the agent untouched; a streaming multipart parser watches it go by and counts
the data of the `file` part. A body it cannot parse counts nothing (the agent
refuses such a body, and a refused upload is not metered anyway).
"""

from __future__ import annotations

from python_multipart.multipart import MultipartParser, parse_options_header

FILE_FIELD = b"file"


class FileBytes:
    """Feed it the body's chunks; `count` is the bytes of the `file` part seen so far."""

    def __init__(self, content_type: str | None) -> None:
        self.count = 0
        self._header_field = b""
        self._header_value = b""
        self._in_file = False
        self._parser: MultipartParser | None = None
        kind, options = parse_options_header(content_type or "")
        boundary = options.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            return
        self._parser = MultipartParser(boundary, callbacks={
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field_data,
            "on_header_value": self._header_value_data,
            "on_header_end": self._header_end,
            "on_part_data": self._part_data,
        })

    def feed(self, chunk: bytes) -> None:
        if self._parser is None:
            return
        try:
            self._parser.write(chunk)
        except Exception:  # noqa: BLE001 - a body it cannot parse counts nothing; the relay goes on
            self._parser = None

    def _part_begin(self) -> None:
        self._in_file = False

    def _header_field_data(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _header_value_data(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _header_end(self) -> None:
        if self._header_field.lower() == b"content-disposition":
            _, options = parse_options_header(self._header_value)
            self._in_file = options.get(b"name") == FILE_FIELD
        self._header_field = self._header_value = b""

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            self.count += end - start
