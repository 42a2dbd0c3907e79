"""The egress proxy's Prometheus metrics, on a registry of its own.

Label values are closed sets (kinds, refusal reasons, outcomes, directions):
never a workspace, session, host or credential. Per-workspace figures are in
the usage counters (`egress_bytes`), not here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from sandpool.contract.reasons import EgressRefusal

SERVICE = "egress"


class EgressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.connections = Counter("sandpool_egress_connections_total",
                                   "Connections relayed to a destination, by kind and how they ended",
                                   ["kind", "outcome"], registry=self.registry)
        self.refusals = Counter("sandpool_egress_refusals_total", "Requests refused, by reason",
                                ["reason"], registry=self.registry)
        self.bytes = Counter("sandpool_egress_bytes_total", "Bytes relayed, by direction (in: towards sandboxes)",
                             ["direction"], registry=self.registry)
        self.active = Gauge("sandpool_egress_active_connections", "Client connections open now",
                            registry=self.registry)
        self.redis_errors = Counter("sandpool_redis_errors_total", "Redis calls that failed",
                                    ["service"], registry=self.registry)
        self.meter_failures = Counter("sandpool_egress_meter_failures_total",
                                      "Connections whose bytes could not be written to usage after retries",
                                      registry=self.registry)
        self.unsafe = Gauge("sandpool_egress_unsafe_test_mode",
                            "1 when loopback destinations are admitted (--unsafe-allow-loopback-for-tests)",
                            registry=self.registry)

    def refused(self, reason: EgressRefusal) -> None:
        self.refusals.labels(reason.value).inc()

    def relayed(self, kind: str, outcome: str, bytes_in: int, bytes_out: int) -> None:
        self.connections.labels(kind, outcome).inc()
        self.bytes.labels("in").inc(bytes_in)
        self.bytes.labels("out").inc(bytes_out)

    def redis_error(self) -> None:
        self.redis_errors.labels(SERVICE).inc()
