"""What the egress proxy answers itself: `/healthz`, `/readyz` and, on the metrics listener only, `/metrics`.

Probes are origin-form requests (`GET /healthz HTTP/1.1`), which a proxy request
never is, so they share the port sandboxes reach without a credential; they say
nothing about any tenant. Metrics stay off that port.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sandpool.contract.reasons import EgressRefusal
from sandpool.egress.http import NOT_PROXIED, Refusal, RequestHead, answer, refusal_bytes
from sandpool.egress.metrics import EgressMetrics
from sandpool.state.egress import EgressStore
from sandpool.state.errors import StateError


async def local_answer(head: RequestHead, *, store: EgressStore, metrics: EgressMetrics, unsafe: bool,
                       metrics_listener: bool) -> bytes:
    """The complete response to an origin-form request."""
    path = head.target.split("?", 1)[0]
    if head.method not in ("GET", "HEAD") or path not in ("/healthz", "/readyz", "/metrics"):
        response = (answer(404, "not found", phrase="Not Found") if metrics_listener
                    else refusal_bytes(Refusal(EgressRefusal.NOT_PROXY_REQUEST, NOT_PROXIED)))
    elif path == "/healthz":
        notice = " (UNSAFE TEST MODE: loopback admitted)" if unsafe else ""
        response = answer(200, "ok" + notice, phrase="OK")
    elif path == "/readyz":
        try:
            ready = await store.ping()
        except StateError:
            metrics.redis_error()
            ready = False
        response = (answer(200, "ready", phrase="OK") if ready
                    else answer(503, "Redis unreachable", phrase="Service Unavailable"))
    elif metrics_listener:
        body = generate_latest(metrics.registry)
        response = (f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE_LATEST}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode("latin-1") + body
    else:
        response = refusal_bytes(Refusal(EgressRefusal.NOT_PROXY_REQUEST,
                                         "/metrics is served on the metrics port only"))
    if head.method == "HEAD":
        response = response.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
    return response
