"""OpenTelemetry tracing, off by default (`--tracing`; the `tracing` extra).

On, a service makes a span for every request it serves and every HTTP call it makes
(httpx, raw transports included), and passes W3C trace context on, so one trace
shows the proxy, the scheduler and the hop to the sandbox's agent. Spans go over
OTLP/HTTP to the endpoint the standard `OTEL_EXPORTER_OTLP_*` variables name
(default http://localhost:4318). Probes and scrapes are not traced. Span names and
attributes carry URL paths (session ids), never bodies or credentials.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sandpool.core.settings import ConfigurationError

log = logging.getLogger(__name__)

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
    log.info("tracing on", extra={"service_name": f"sandpool-{service}"})
    return provider


async def shutdown(provider: Any) -> None:
    """Flush and stop a provider `instrument` returned (None: tracing was off). Off the event
    loop: an unreachable collector costs the exporter's timeout, not a stalled shutdown."""
    if provider is not None:
        await asyncio.to_thread(provider.shutdown)
