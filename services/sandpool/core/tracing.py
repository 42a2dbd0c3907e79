"""OpenTelemetry tracing, off by default (`--tracing`; the `tracing` extra).

On, a service makes a span for every request it serves and every HTTP call it makes
(httpx, and the internal hops of `core.hop` through `hop_span`), and passes W3C trace context on, so one trace
shows the api and its hop to the sandbox's agent. Spans go over
OTLP/HTTP to the endpoint the standard `OTEL_EXPORTER_OTLP_*` variables name
(default http://localhost:4318). Probes and scrapes are not traced. Span names and
attributes carry URL paths (session ids), never bodies or credentials.
"""

from __future__ import annotations

import asyncio
import logging
from types import TracebackType
from typing import Any

from sandpool.core.settings import ConfigurationError

log = logging.getLogger(__name__)

_hop_tracer: Any = None
"""The tracer of `hop_span`, set by `instrument`: None while tracing is off."""

EXTRA_HINT = "tracing needs the tracing extra: pip install 'sandpool[tracing]'"
UNTRACED_PATHS = "healthz,readyz,metrics"


class TracingUnavailable(ConfigurationError):
    """`--tracing` was asked for but the OpenTelemetry packages are not installed: the command
    stops with this message (exit 2), not a traceback."""


def instrument(app: Any, service: str, *, exporter: Any = None) -> Any:
    """Trace `app` and every httpx call of this process; returns the tracer provider, which the
    caller shuts down (flushing what is buffered) when the service stops."""
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(EXTRA_HINT) from exc
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": f"sandpool-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, excluded_urls=UNTRACED_PATHS)
    httpx_instrumentor = HTTPXClientInstrumentor()
    if not httpx_instrumentor.is_instrumented_by_opentelemetry:  # once per process
        httpx_instrumentor.instrument(tracer_provider=provider)
    global _hop_tracer
    _hop_tracer = provider.get_tracer("sandpool.hop")
    log.info("tracing on", extra={"service_name": f"sandpool-{service}"})
    return provider


class _HopSpan:
    """A client span around one internal hop, trace context added to its headers; free when off."""

    __slots__ = ("_headers", "_method", "_peer", "_scope", "_span", "_target")

    def __init__(self, method: str, target: str, headers: list[tuple[str, str]], peer: str) -> None:
        self._method, self._target, self._headers, self._peer = method, target, headers, peer
        self._scope: Any = None
        self._span: Any = None

    def __enter__(self) -> _HopSpan:
        if _hop_tracer is not None:
            from opentelemetry import propagate
            from opentelemetry.trace import SpanKind

            self._scope = _hop_tracer.start_as_current_span(
                f"{self._method} {self._peer}", kind=SpanKind.CLIENT,
                attributes={"http.request.method": self._method, "url.path": self._target.split("?", 1)[0],
                            "server.address": self._peer})
            self._span = self._scope.__enter__()
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            self._headers.extend(carrier.items())
        return self

    def status(self, code: int) -> None:
        if self._span is not None:
            self._span.set_attribute("http.response.status_code", code)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._scope is not None:
            self._scope.__exit__(kind, exc, tb)


def hop_span(method: str, target: str, headers: list[tuple[str, str]], *, peer: str) -> _HopSpan:
    """`with hop_span(...) as span:` around a `core.hop` request; `span.status(code)` once answered."""
    return _HopSpan(method, target, headers, peer)


async def shutdown(provider: Any) -> None:
    """Flush and stop a provider `instrument` returned (None: tracing was off). Off the event
    loop: an unreachable collector costs the exporter's timeout, not a stalled shutdown."""
    if provider is not None:
        await asyncio.to_thread(provider.shutdown)
