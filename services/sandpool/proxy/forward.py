"""Byte-for-byte forwarding to the scheduler over one pooled HTTP client.

Bodies are streamed both ways (the request body is counted against the cap as
it passes, the response is relayed as raw bytes, never decoded and re-encoded).
Hop-by-hop headers are dropped, and so is everything the client may not say to
the scheduler: its `Authorization` (replaced by the internal credential) and any
`X-Sandpool-*` header (replaced by the values derived from the verified token).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sandpool.contract import tenancy
from sandpool.core.errors import PayloadTooLarge, Unavailable

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade"})
# `expect` was answered by the proxy's own server; the scheduler gets the body it asked for.
_NOT_FORWARDED = HOP_BY_HOP | {"host", "authorization", "expect", tenancy.REQUEST_ID.lower()}


class SchedulerUnavailable(Unavailable):
    reason = "scheduler_unavailable"


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


def downstream_headers(headers: httpx.Headers) -> list[tuple[bytes, bytes]]:
    raw = headers.raw
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


def make_transport(scheduler_url: str, *, max_connections: int) -> tuple[httpx.AsyncHTTPTransport, str]:
    """The pooled transport to the scheduler and the base URL requests are built on.

    The proxy talks to the transport directly rather than through an
    `httpx.AsyncClient`: a client keeps a cookie jar (a cookie one tenant's call
    received must never ride along on another tenant's call), follows its own
    redirect and auth logic, and costs more per call than the forward needs.
    """
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    if scheduler_url.startswith("unix://"):
        return httpx.AsyncHTTPTransport(uds=scheduler_url[len("unix://"):], limits=limits), "http://scheduler"
    return httpx.AsyncHTTPTransport(limits=limits), scheduler_url


SMALL_RESPONSE = 64 * 1024
"""Responses up to this size (by Content-Length) are relayed in one piece: same bytes, less machinery."""


class Forwarder:
    def __init__(self, transport: httpx.AsyncBaseTransport, base_url: str, *, max_body_bytes: int,
                 connect_timeout: float, timeout: float) -> None:
        self.transport = transport
        self.base_url = base_url
        self.max_body_bytes = max_body_bytes
        self.timeouts = {"connect": connect_timeout, "read": timeout, "write": timeout, "pool": connect_timeout}

    async def forward(self, request: Request, injected: list[tuple[str, str]], request_id: str,
                      *, body: bytes | None = None) -> Response:
        """Relay `request` to the scheduler; `body` when the caller already read it (CreateSession)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise BodyTooLarge(f"request body is over the {self.max_body_bytes}-byte limit")
        headers = upstream_headers(request.scope["headers"], injected)
        headers.append((tenancy.REQUEST_ID, request_id))
        content = body if body is not None else (
            capped_body(request, self.max_body_bytes) if request.method in ("POST", "PUT", "PATCH") else None)
        path = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string", b"")
        url = self.base_url + path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        upstream_request = httpx.Request(request.method, url, headers=headers, content=content,
                                         extensions={"timeout": self.timeouts})
        try:
            upstream = await self.transport.handle_async_request(upstream_request)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise SchedulerUnavailable("the scheduler is unreachable", retry_after=1) from exc
        except httpx.TimeoutException as exc:
            raise SchedulerUnavailable("the scheduler did not answer in time", retry_after=1) from exc
        except httpx.TransportError as exc:
            raise SchedulerUnavailable("the connection to the scheduler failed", retry_after=1) from exc
        raw_headers = downstream_headers(upstream.headers)  # the edge adds X-Request-Id
        length = upstream.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) <= SMALL_RESPONSE:
            try:
                content_bytes = b"".join([chunk async for chunk in upstream.aiter_raw()])
            except httpx.TransportError as exc:
                raise SchedulerUnavailable("the connection to the scheduler failed", retry_after=1) from exc
            finally:
                await upstream.aclose()
            response = Response(content_bytes, status_code=upstream.status_code)
        else:
            response = StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                         background=BackgroundTask(upstream.aclose))
        response.raw_headers = raw_headers
        return response
