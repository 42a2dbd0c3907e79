"""OpenTelemetry tracing, end to end: `sandpool up` with tracing on exports its spans over OTLP/HTTP
to a collector on loopback (a real HTTP server decoding the protobuf export requests), and one
call through the api is one trace: the api's server span and its hop to the agent, in the caller's
trace."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from testkit import wait_for
from up_harness import assert_stopped_clean


class Collector:
    """Accepts OTLP/HTTP (protobuf) trace exports and keeps every span with its service name."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                collector.add(request, self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest, path: str) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append({"service": attrs.get("service.name"), "path": path,
                                           "name": span.name, "kind": span.kind,
                                           "trace_id": span.trace_id.hex(), "parent": span.parent_span_id.hex(),
                                           "attributes": {a.key: str(a.value) for a in span.attributes}})

    def snapshot(self) -> list[dict]:
        with self.lock:
            return list(self.spans)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_one_call_is_one_trace_across_the_api_and_its_agent_hop(up_factory, monkeypatch) -> None:
    collector = Collector()
    monkeypatch.setenv("SANDPOOL_TRACING", "true")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 100 ms, not 5 s
    try:
        up = up_factory()
        url, token = up.printed("SANDPOOL_URL="), up.printed("SANDPOOL_TOKEN=")
        with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {token}"}) as client:
            sid = client.post("/sessions", json={}).json()["session_id"]
            answer = client.post(f"/sessions/{sid}/exec", json={"tool": "code_execution", "input": {"code": "1"}},
                                 headers={"traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"})
            assert answer.status_code == 200, answer.text
            assert client.delete(f"/sessions/{sid}").status_code == 204
        trace = "ab" * 16  # the caller's trace context is joined, not replaced

        def whole_trace() -> list[dict]:
            # Spans are exported in batches: wait until the server span and the hop to the agent are in
            # (a span missing for good still fails, at the wait's end, showing what came).
            spans = [s for s in collector.snapshot() if s["trace_id"] == trace]
            kinds = {s["kind"] for s in spans}
            return spans if {2, 3} <= kinds else []  # SPAN_KIND_SERVER and SPAN_KIND_CLIENT

        spans = wait_for(whole_trace, timeout=30, interval=0.1, what="the whole trace", state=collector.snapshot)
        assert all(s["path"] == "/v1/traces" for s in spans)
        # One process on the request path: every span of the call is the api's (the controller serves none).
        assert {s["service"] for s in spans} == {"sandpool-api"}, spans
        server_spans = [s for s in spans if s["kind"] == 2]
        assert any(s["parent"] == "cd" * 8 for s in server_spans), server_spans  # a child of the caller's span
        to_agent = [s for s in spans if s["kind"] == 3]  # SPAN_KIND_CLIENT: the api's hop to the agent
        assert any("/exec" in str(s["attributes"]) for s in to_agent), to_agent
        # Probes are not traced; no span carries the bearer token.
        everything = collector.snapshot()
        assert not any("healthz" in s["name"] or "readyz" in s["name"] for s in everything)
        assert token.split(".")[2] not in str(everything)
        assert_stopped_clean(up)
    finally:
        collector.close()
