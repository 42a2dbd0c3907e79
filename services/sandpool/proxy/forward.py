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
from starlette.responses import StreamingResponse

from sandpool.contract import tenancy
from sandpool.core.errors import PayloadTooLarge, Unavailable

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade"})
_NOT_FORWARDED = HOP_BY_HOP | {"host", "authorization", tenancy.REQUEST_ID.lower()}


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


def make_client(scheduler_url: str, *, connect_timeout: float, timeout: float, max_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    timeouts = httpx.Timeout(timeout, connect=connect_timeout, pool=connect_timeout)
    if scheduler_url.startswith("unix://"):
        transport = httpx.AsyncHTTPTransport(uds=scheduler_url[len("unix://"):], limits=limits)
        return httpx.AsyncClient(transport=transport, base_url="http://scheduler", timeout=timeouts)
    transport = httpx.AsyncHTTPTransport(limits=limits)
    return httpx.AsyncClient(transport=transport, base_url=scheduler_url, timeout=timeouts)


class Forwarder:
    def __init__(self, client: httpx.AsyncClient, *, max_body_bytes: int) -> None:
        self.client = client
        self.max_body_bytes = max_body_bytes

    async def forward(self, request: Request, injected: list[tuple[str, str]], request_id: str,
                      *, body: bytes | None = None) -> StreamingResponse:
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
        url = path.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        upstream_request = self.client.build_request(request.method, url, headers=headers, content=content)
        try:
            upstream = await self.client.send(upstream_request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise SchedulerUnavailable("the scheduler is unreachable", retry_after=1) from exc
        except httpx.TimeoutException as exc:
            raise SchedulerUnavailable("the scheduler did not answer in time", retry_after=1) from exc
        except httpx.TransportError as exc:
            raise SchedulerUnavailable("the connection to the scheduler failed", retry_after=1) from exc
        response = StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                     background=BackgroundTask(upstream.aclose))
        response.raw_headers = downstream_headers(upstream.headers)  # the edge adds X-Request-Id
        return response
