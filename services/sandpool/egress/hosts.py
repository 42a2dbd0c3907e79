"""Host names and authorities in one canonical form, so every comparison is a plain string equality.

A name is IDNA-normalised (UTS #46, as curl and browsers do), lower-cased and
stripped of the one trailing dot of its absolute form (`Example.COM.` is
`example.com`); anything else that is not a well-formed DNS name is refused:
empty or over-long labels, a second trailing dot, characters outside letters,
digits, `-` and `_`, invalid punycode, and names whose last label is numeric
(`127.1`, `0x7f.1`, `2130706433`: resolvers read those as addresses, so they
would smuggle an address past a name-based allow-list). An address literal is
kept as an address (`ipaddress`), IPv6 in brackets in an authority.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

import idna

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_NAME = 253
_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_NUMERIC_LABEL = re.compile(r"^(?:[0-9]+|0x[0-9a-f]*)$")
_PORT = re.compile(r"^[0-9]{1,5}$")


class BadHost(ValueError):
    """Not a host name or address this proxy will talk about; the message says why."""


def normalise_name(raw: str) -> str:
    """The canonical ASCII form of a DNS name, or `BadHost`."""
    if not raw or len(raw) > 2 * MAX_NAME:
        raise BadHost("empty or over-long host name")
    name = raw[:-1] if raw.endswith(".") else raw
    if not name or name.endswith(".") or name.startswith("."):
        raise BadHost(f"malformed host name {raw!r}")
    if not name.isascii():
        try:
            name = idna.encode(name, uts46=True).decode("ascii")
        except idna.IDNAError as exc:
            raise BadHost(f"invalid international host name ({exc})") from None
    name = name.lower()
    if len(name) > MAX_NAME:
        raise BadHost("host name longer than 253 characters")
    labels = name.split(".")
    for label in labels:
        if not _LABEL.match(label):
            raise BadHost(f"malformed host name {printable(raw)!r}")
        if label.startswith("xn--"):
            try:
                idna.decode(label)
            except idna.IDNAError:
                raise BadHost(f"invalid punycode in host name {printable(raw)!r}") from None
    if _NUMERIC_LABEL.match(labels[-1]):
        raise BadHost(f"{printable(raw)!r} looks like a numeric address: write an address literally")
    return name


def parse_address(raw: str) -> IPAddress | None:
    """An address literal in its canonical form (IPv6 without brackets or zone), or None for a name."""
    text = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
    if "%" in text:
        raise BadHost("scoped IPv6 addresses are refused")
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        if raw.startswith("["):
            raise BadHost(f"malformed IPv6 literal {printable(raw)!r}") from None
        return None


@dataclass(frozen=True)
class Host:
    """A destination host: a canonical name, or an address literal (then `name` is its text)."""

    name: str
    address: IPAddress | None = None

    @property
    def is_literal(self) -> bool:
        return self.address is not None

    def __str__(self) -> str:
        if self.address is not None and self.address.version == 6:
            return f"[{self.name}]"
        return self.name


def parse_host(raw: str) -> Host:
    address = parse_address(raw)
    if address is not None:
        return Host(str(address), address)
    return Host(normalise_name(raw))


@dataclass(frozen=True)
class Destination:
    host: Host
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_port(raw: str) -> int:
    if not _PORT.match(raw) or not 0 < int(raw) < 65536:
        raise BadHost(f"bad port {printable(raw)!r}")
    return int(raw)


def split_authority(authority: str, *, default_port: int | None) -> tuple[str, int]:
    """`host:port`, `[v6]:port`, or (with a default port) a bare host, as raw host text and port."""
    if authority.startswith("["):
        close = authority.find("]")
        if close < 0:
            raise BadHost(f"malformed authority {printable(authority)!r}")
        host, rest = authority[: close + 1], authority[close + 1:]
        if not rest:
            if default_port is None:
                raise BadHost("a port is required")
            return host, default_port
        if not rest.startswith(":"):
            raise BadHost(f"malformed authority {printable(authority)!r}")
        return host, parse_port(rest[1:])
    host, colon, port = authority.rpartition(":")
    if not colon:
        if default_port is None:
            raise BadHost("a port is required")
        return authority, default_port
    if ":" in host:
        raise BadHost("an IPv6 address must be in brackets")
    return host, parse_port(port)


def parse_authority(authority: str, *, default_port: int | None = None) -> Destination:
    """A CONNECT authority (`host:port`) or a URL's netloc, checked and canonical."""
    if not authority or len(authority) > 2 * MAX_NAME + 8 or "@" in authority:
        raise BadHost("malformed authority")
    raw_host, port = split_authority(authority, default_port=default_port)
    return Destination(parse_host(raw_host), port)


def printable(text: str, limit: int = 80) -> str:
    """Text from a request, safe to quote in a message or a log line (no control characters, bounded)."""
    cleaned = "".join(ch if ch.isprintable() else "?" for ch in text[:limit])
    return cleaned + ("..." if len(text) > limit else "")
