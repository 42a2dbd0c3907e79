"""The first bytes of a tunnel: a TLS ClientHello, and the server name (SNI) it asks for.

A CONNECT tunnel is admitted for its authority, but the bytes inside are the
client's: a client could open a tunnel to an allowed name and then ask, in its
ClientHello, for another site the same server or CDN also serves. So the proxy
reads the ClientHello before relaying anything, and the tunnel carries on only
when the SNI names the CONNECT host. Only the TLS record and handshake framing
and the extensions block are parsed (RFC 8446 4.1.2, RFC 6066 3); anything
malformed, ambiguous (a second server_name, several host names) or opaque
(Encrypted Client Hello, whose inner name the proxy cannot see) is refused.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

RECORD_HANDSHAKE = 22
HANDSHAKE_CLIENT_HELLO = 1
EXT_SERVER_NAME = 0
EXT_ENCRYPTED_CLIENT_HELLO = 0xFE0D
NAME_TYPE_HOST = 0
MAX_RECORD = 16384 + 2048  # a plaintext record is at most 2^14 bytes; some slack, still bounded

ALERT_ACCESS_DENIED = bytes([21, 3, 1, 0, 2, 2, 49])
"""A fatal TLS `access_denied` alert: what a refused tunnel's client reads instead of a ServerHello."""


class NotClientHello(ValueError):
    """The first bytes are not a well-formed TLS ClientHello; the message says what is wrong."""


@dataclass(frozen=True)
class ClientHello:
    raw: bytes  # every byte read from the client, to be relayed as it is
    server_name: str | None  # the host_name of the server_name extension, as sent
    encrypted: bool  # carries an Encrypted Client Hello extension


async def read_client_hello(reader: asyncio.StreamReader, *, max_bytes: int) -> ClientHello:
    """Read exactly the records that carry the ClientHello (it may span several) and parse it."""
    raw = bytearray()
    handshake = bytearray()
    need: int | None = None
    while need is None or len(handshake) < need:
        header = await reader.readexactly(5)
        raw += header
        kind, major, length = header[0], header[1], int.from_bytes(header[3:5], "big")
        if kind != RECORD_HANDSHAKE or major != 3:
            raise NotClientHello("the tunnel did not start with a TLS handshake")
        if length == 0 or length > MAX_RECORD:
            raise NotClientHello("bad TLS record length")
        if len(raw) + length > max_bytes:
            raise NotClientHello(f"ClientHello larger than {max_bytes} bytes")
        body = await reader.readexactly(length)
        raw += body
        handshake += body
        if need is None and len(handshake) >= 4:
            if handshake[0] != HANDSHAKE_CLIENT_HELLO:
                raise NotClientHello("the first handshake message is not a ClientHello")
            need = 4 + int.from_bytes(handshake[1:4], "big")
            if need > max_bytes:
                raise NotClientHello(f"ClientHello larger than {max_bytes} bytes")
    if len(handshake) != need:
        raise NotClientHello("unexpected data after the ClientHello")
    name, encrypted = parse_client_hello(bytes(handshake[4:need]))
    return ClientHello(bytes(raw), name, encrypted)


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise NotClientHello("truncated ClientHello")
        out = self.data[self.pos: self.pos + n]
        self.pos += n
        return out

    def number(self, width: int) -> int:
        return int.from_bytes(self.take(width), "big")

    def vector(self, width: int) -> bytes:
        return self.take(self.number(width))

    @property
    def left(self) -> int:
        return len(self.data) - self.pos


def parse_client_hello(body: bytes) -> tuple[str | None, bool]:
    """(the SNI host name or None, whether ECH is offered) of a ClientHello body (after its 4-byte header)."""
    cur = _Cursor(body)
    if cur.number(1) != 3:
        raise NotClientHello("unknown ClientHello version")
    cur.take(1 + 32)  # minor version, random
    if len(cur.vector(1)) > 32:
        raise NotClientHello("session id longer than 32 bytes")
    suites = cur.vector(2)
    if not suites or len(suites) % 2:
        raise NotClientHello("bad cipher suite list")
    if not cur.vector(1):
        raise NotClientHello("no compression method")
    if cur.left == 0:
        return None, False  # no extensions at all (an old client): no SNI
    extensions = _Cursor(cur.vector(2))
    if cur.left:
        raise NotClientHello("trailing bytes after the extensions")
    seen: set[int] = set()
    name: str | None = None
    encrypted = False
    while extensions.left:
        kind = extensions.number(2)
        data = extensions.vector(2)
        if kind in seen:
            raise NotClientHello(f"extension {kind} sent twice")
        seen.add(kind)
        if kind == EXT_SERVER_NAME:
            name = _server_name(data)
        elif kind == EXT_ENCRYPTED_CLIENT_HELLO:
            encrypted = True
    return name, encrypted


def _server_name(data: bytes) -> str:
    cur = _Cursor(data)
    names = _Cursor(cur.vector(2))
    if cur.left:
        raise NotClientHello("trailing bytes in server_name")
    found: list[bytes] = []
    while names.left:
        kind = names.number(1)
        value = names.vector(2)
        if kind != NAME_TYPE_HOST:
            raise NotClientHello("unknown server name type")
        found.append(value)
    if len(found) != 1 or not found[0]:
        raise NotClientHello("server_name must carry exactly one host name")
    try:
        return found[0].decode("ascii")
    except UnicodeDecodeError:
        raise NotClientHello("server name is not ASCII") from None
