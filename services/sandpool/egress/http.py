"""HTTP/1.1 as a forward proxy needs it: a request head read within bounds, and the proxy's own answers.

Parsing is strict, because what the proxy and an origin server make of one
request must agree: CRLF line ends only, no folded header lines, token header
names, one unambiguous body framing (Content-Length, or chunked and nothing
else; both at once is request smuggling and refused). A plain-HTTP request is
sent on in origin form with the URL's authority as its Host header, every
hop-by-hop header removed (the proxy credential above all) and
`Connection: close`: one request per connection, so a second request on the
same connection can never reach a host that was not checked.

The proxy's refusals carry their explanation in the status line's reason phrase
as well as the body: on a refused CONNECT, clients show only the status line
(pip: `Tunnel connection failed: 403 ...`).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

from sandpool.contract.reasons import EGRESS_REFUSALS, EgressRefusal
from sandpool.egress.hosts import BadHost, Destination, parse_authority, printable

MAX_HEADERS = 100
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_METHOD = re.compile(r"^[A-Z][A-Z-]{0,19}$")
_TARGET_BAD = re.compile(r"[\x00-\x20\x7f]")
HOP_BY_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "proxy-authorization", "proxy-authenticate",
                        "te", "trailer", "upgrade", "host"})
REASONS = {400: "Bad Request", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
           407: "Proxy Authentication Required", 408: "Request Timeout", 429: "Too Many Requests",
           431: "Request Header Fields Too Large", 501: "Not Implemented", 502: "Bad Gateway",
           503: "Service Unavailable", 504: "Gateway Timeout"}


PREFIX = "sandpool egress: "
"""What every refusal's message starts with: a client shows only the status line, and says whose it is."""
NOT_PROXIED = "only CONNECT and absolute http:// requests are proxied"


class Refusal(Exception):
    """A request the proxy answers itself: a refusal word of the catalogue (`contract.reasons.EgressRefusal`),
    which gives its status (`status` picks one when the word has several), and a message for a person."""

    def __init__(self, reason: EgressRefusal, message: str, *, status: int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        statuses = EGRESS_REFUSALS[reason].statuses
        if status is None and len(statuses) == 1:
            status = statuses[0]
        if status is None or status not in statuses:
            raise ValueError(f"{reason} is answered with {statuses or 'no HTTP status'}, not {status}")
        super().__init__(PREFIX + message)
        self.status = status
        self.reason = reason
        self.message = PREFIX + message
        self.headers = headers or {}


def bad_request(message: str) -> Refusal:
    """A malformed request: 400, `bad_request`."""
    return Refusal(EgressRefusal.BAD_REQUEST, message, status=400)


@dataclass(frozen=True)
class RequestHead:
    method: str
    target: str
    version: str
    headers: tuple[tuple[str, str], ...]

    def values(self, name: str) -> list[str]:
        lower = name.lower()
        return [value for key, value in self.headers if key.lower() == lower]

    def single(self, name: str) -> str | None:
        found = self.values(name)
        if len(found) > 1:
            raise bad_request(f"more than one {name} header")
        return found[0] if found else None


async def read_head(reader: asyncio.StreamReader, *, max_bytes: int) -> RequestHead | None:
    """The next request head, or None when the client closed before sending one.
    The reader's buffer limit must be at least `max_bytes` (the server sets it)."""
    try:
        data = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise Refusal(EgressRefusal.HEAD_TOO_LARGE, f"request head larger than {max_bytes} bytes") from None
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise bad_request("incomplete request head") from None
    if len(data) > max_bytes:
        raise Refusal(EgressRefusal.HEAD_TOO_LARGE, f"request head larger than {max_bytes} bytes")
    return parse_head(data[:-4])


def parse_head(data: bytes) -> RequestHead:
    lines = data.split(b"\r\n")
    try:
        request_line = lines[0].decode("ascii")
    except UnicodeDecodeError:
        raise bad_request("request line is not ASCII") from None
    parts = request_line.split(" ")
    if len(parts) != 3 or not _METHOD.match(parts[0]) or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise bad_request("malformed request line")
    if not parts[1] or _TARGET_BAD.search(parts[1]):
        raise bad_request("malformed request target")
    if len(lines) - 1 > MAX_HEADERS:
        raise Refusal(EgressRefusal.HEAD_TOO_LARGE, f"more than {MAX_HEADERS} header lines")
    headers = []
    for raw in lines[1:]:
        if raw[:1] in (b" ", b"\t"):
            raise bad_request("folded header lines are not accepted")
        name, colon, value = raw.partition(b":")
        text_name = name.decode("latin-1")
        if not colon or not _TOKEN.match(text_name):
            raise bad_request("malformed header line")
        text_value = value.decode("latin-1").strip(" \t")
        if any(ord(ch) < 0x20 and ch != "\t" or ord(ch) == 0x7F for ch in text_value):
            raise bad_request("control character in a header value")
        headers.append((text_name, text_value))
    return RequestHead(parts[0], parts[1], parts[2], tuple(headers))


@dataclass(frozen=True)
class AbsoluteRequest:
    destination: Destination
    origin_target: str  # path and query, for the origin server


def parse_absolute(target: str) -> AbsoluteRequest:
    """`http://host[:port]/path?query` (the form a client sends a forward proxy)."""
    scheme, sep, rest = target.partition("://")
    if not sep:
        raise Refusal(EgressRefusal.NOT_PROXY_REQUEST, NOT_PROXIED)
    if scheme.lower() != "http":
        raise Refusal(EgressRefusal.SCHEME_REFUSED,
                      f"{printable(scheme.lower())}:// is not proxied (use CONNECT for https)")
    cut = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    if "@" in authority:
        raise bad_request("credentials in the URL are not forwarded")
    try:
        destination = parse_authority(authority, default_port=80)
    except BadHost as exc:
        raise Refusal(EgressRefusal.BAD_DESTINATION, f"bad destination: {exc}") from None
    tail = tail.split("#", 1)[0]
    if not tail.startswith("/"):
        tail = "/" + tail
    return AbsoluteRequest(destination, tail)


@dataclass(frozen=True)
class Framing:
    kind: str  # "none" | "length" | "chunked"
    length: int = 0


def body_framing(head: RequestHead) -> Framing:
    encodings = [v.strip().lower() for value in head.values("transfer-encoding") for v in value.split(",")]
    lengths = head.values("content-length")
    if encodings and lengths:
        raise bad_request("both Transfer-Encoding and Content-Length")
    if encodings:
        if encodings != ["chunked"]:
            raise Refusal(EgressRefusal.BAD_REQUEST, "only the chunked transfer coding is supported", status=501)
        return Framing("chunked")
    if lengths:
        if len(set(lengths)) != 1 or not lengths[0].isdigit() or len(lengths[0]) > 18:
            raise bad_request("bad Content-Length")
        return Framing("length", int(lengths[0]))
    return Framing("none")


def origin_head(head: RequestHead, request: AbsoluteRequest) -> bytes:
    """The head sent to the origin: origin form, its own Host, no hop-by-hop header, one request only."""
    named = {token.strip().lower() for value in head.values("connection") for token in value.split(",")}
    drop = HOP_BY_HOP | named
    host = str(request.destination.host)
    if request.destination.port != 80:
        host += f":{request.destination.port}"
    lines = [f"{head.method} {request.origin_target} {head.version}", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in head.headers if name.lower() not in drop]
    lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


_STATUS_LINE = re.compile(rb"^HTTP/1\.[01] ([1-5][0-9][0-9])(?: |\r\n)")


def client_response_head(head: bytes) -> tuple[int, bytes]:
    """An origin's response head as the client gets it: its status, and the head with the connection
    headers replaced by `Connection: close` (the proxy serves one request per connection, so the client
    must not send another on it). `BodyError`-worthy heads raise `ValueError`."""
    match = _STATUS_LINE.match(head)
    if not match:
        raise ValueError("not an HTTP/1.x response")
    lines = head[:-4].split(b"\r\n")
    named = {token.strip().lower() for line in lines[1:] if line[:11].lower() == b"connection:"
             for token in line[11:].split(b",")}
    drop = {b"connection", b"keep-alive", b"proxy-connection"} | named
    kept = [line for line in lines[1:] if line.partition(b":")[0].strip().lower() not in drop]
    return int(match.group(1)), b"\r\n".join([lines[0], *kept, b"Connection: close"]) + b"\r\n\r\n"


def _phrase(text: str) -> str:
    cleaned = "".join(ch if 0x20 <= ord(ch) < 0x7F else "?" for ch in text)
    return cleaned[:240]


def answer(status: int, message: str, *, reason: EgressRefusal | None = None, headers: dict[str, str] | None = None,
           phrase: str | None = None) -> bytes:
    """A complete response the proxy sends itself (plain text; the connection closes after it)."""
    body = (message + "\n").encode("utf-8")
    lines = [f"HTTP/1.1 {status} {_phrase(phrase if phrase is not None else message) or REASONS.get(status, '')}",
             "Content-Type: text/plain; charset=utf-8", f"Content-Length: {len(body)}", "Connection: close",
             "Cache-Control: no-store"]
    if reason is not None:
        lines.append(f"X-Sandpool-Egress-Refusal: {reason}")
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def refusal_bytes(refusal: Refusal) -> bytes:
    return answer(refusal.status, refusal.message, reason=refusal.reason, headers=refusal.headers)


ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"
