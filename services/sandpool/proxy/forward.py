"""Byte-for-byte forwarding to the scheduler over one pool of keep-alive connections (`core.hop`).

Bodies are streamed both ways (the request body is counted against the cap as
it passes, the response is relayed as raw bytes, never decoded and re-encoded).
Hop-by-hop headers are dropped, and so is everything the client may not say to
the scheduler: its `Authorization` (replaced by the internal credential) and any
`X-Sandpool-*` header (replaced by the values derived from the verified token).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sandpool.contract import tenancy
from sandpool.contract.reasons import Reason
from sandpool.core import tracing
from sandpool.core.errors import PayloadTooLarge, Unavailable
from sandpool.core.hop import HopBusy, HopConnectError, HopError, HopPool, HopTimeout

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade"})
# `expect` was answered by the proxy's own server; the scheduler gets the body it asked for. The
# body's framing (`content-length`) is the hop's own, from what it actually sends.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "authorization", "expect", "content-length", tenancy.REQUEST_ID.lower()}


class SchedulerUnavailable(Unavailable):
    reason = Reason.SCHEDULER_UNAVAILABLE


class BodyTooLarge(PayloadTooLarge):
    pass


def _connection_listed(headers: Iterable[tuple[bytes, bytes]]) -> set[str]:
    """Header names a `Connection:` header declares hop-by-hop (RFC 9110 §7.6.1)."""
    named: set[str] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named.update(part.strip().lower() for part in value.decode("latin-1").split(","))
    return named


def upstream_headers(raw: list[tuple[bytes, bytes]], injected: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The client's end-to-end headers minus anything tenancy-shaped, plus what the proxy injects."""
    extra_hop = _connection_listed(raw)
    out = []
    for name_b, value_b in raw:
        name = name_b.decode("latin-1").lower()
        if name in _NOT_FORWARDED or name in extra_hop or name.startswith(tenancy.HEADER_PREFIX):
            continue
        out.append((name, value_b.decode("latin-1")))
    out.extend(injected)
    return out


# The proxy's own server sets these (and the edge sets X-Request-Id): relaying them would duplicate them.
_NOT_RELAYED = HOP_BY_HOP | {"date", "server", tenancy.REQUEST_ID.lower()}


def downstream_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    extra_hop = _connection_listed(raw)
    out = []
    for name, value in raw:
        lowered = name.lower().decode("latin-1")
        if lowered not in _NOT_RELAYED and lowered not in extra_hop:
            out.append((name.lower(), value))
    return out


async def capped_body(request: Request, cap: int) -> AsyncIterator[bytes]:
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > cap:
            raise BodyTooLarge(f"request body is over the {cap}-byte limit")
        if chunk:
            yield chunk


SMALL_RESPONSE = 64 * 1024
"""Responses up to this size (by Content-Length) are relayed in one piece: same bytes, less machinery."""


class Forwarder:
    """Relays contract calls to the scheduler. `pool` carries no state between calls but the
    connections themselves (no cookie jar, no redirects): one tenant's call never leaves
    anything behind for another's."""

    def __init__(self, pool: HopPool, *, max_body_bytes: int, timeout: float) -> None:
        self.pool = pool
        self.max_body_bytes = max_body_bytes
        self.timeout = timeout

    async def forward(self, request: Request, injected: list[tuple[str, str]], request_id: str,
                      *, body: bytes | None = None) -> Response:
        """Relay `request` to the scheduler; `body` when the caller already read it (CreateSession)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyTooLarge(f"request body is over the {self.max_body_bytes}-byte limit")
        headers = upstream_headers(request.scope["headers"], injected)
        headers.append((tenancy.REQUEST_ID, request_id))
        content: bytes | AsyncIterator[bytes] | None = body
        if body is None and request.method in ("POST", "PUT", "PATCH"):
            content = capped_body(request, self.max_body_bytes)
        path = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string", b"")
        target = path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        # A streamed body keeps the client's framing: its declared length, else chunked.
        length = int(declared) if declared is not None and declared.isdigit() and body is None else None
        try:
            with tracing.hop_span(request.method, target, headers, peer="scheduler") as span:
                upstream = await self.pool.request(request.method, target, headers, body=content,
                                                   content_length=length, timeout=self.timeout)
                span.status(upstream.status)
        except (HopConnectError, HopBusy) as exc:  # nothing was sent
            raise SchedulerUnavailable("the scheduler is unreachable", retry_after=1) from exc
        except HopTimeout as exc:
            raise SchedulerUnavailable("the scheduler did not answer in time", retry_after=1) from exc
        except HopError as exc:
            raise SchedulerUnavailable("the connection to the scheduler failed", retry_after=1) from exc
        raw_headers = downstream_headers(upstream.headers)  # the edge adds X-Request-Id
        answer_length = upstream.header(b"content-length")
        if answer_length is not None and answer_length.isdigit() and int(answer_length) <= SMALL_RESPONSE:
            try:
                content_bytes = await upstream.read()
            except HopError as exc:
                raise SchedulerUnavailable("the connection to the scheduler failed", retry_after=1) from exc
            finally:
                await upstream.close()
            response = Response(content_bytes, status_code=upstream.status)
            response.raw_headers = raw_headers  # the scheduler's Content-Length is the length read
            return response

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.chunks():
                    yield chunk
            finally:
                await upstream.close()

        response = StreamingResponse(relay(), status_code=upstream.status)
        response.raw_headers = raw_headers
        return response
