"""The api's Prometheus metrics (names fixed in docs/architecture.md): the edge's and the session layer's.

One registry per app, so two apps in one process (tests) never collide. Labels
are closed sets only: operation names, status codes, auth refusal reasons,
outcomes; never a session, sandbox or workspace id. The pools' gauges are the
controller's.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from sandpool.contract.agent_protocol import Outcome

SERVICE = "api"
EXEC_OUTCOMES = tuple(Outcome)
"""The `outcome` labels of `sandpool_executions_total`: the agent's outcome labels."""

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ApiMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("sandpool_requests_total", "Requests served, by operation and status",
                                ["service", "operation", "status"], registry=r)
        self.request_duration = Histogram("sandpool_request_duration_seconds", "Time to the response head",
                                          ["service", "operation"], buckets=_LATENCY_BUCKETS, registry=r)
        self.auth_failures = Counter("sandpool_auth_failures_total", "Refused credentials, by reason",
                                     ["reason"], registry=r)
        self.leases = Counter("sandpool_leases_total", "CreateSession outcomes", ["outcome"], registry=r)
        self.executions = Counter("sandpool_executions_total", "Exec calls that ran, by outcome",
                                  ["tool", "outcome"], registry=r)
        self.execution_duration = Histogram("sandpool_execution_duration_seconds",
                                            "Exec call time (the api's clock)", ["tool"],
                                            buckets=_LATENCY_BUCKETS, registry=r)
        self.reaped = Counter("sandpool_sessions_reaped_total",
                              "Sessions released by sandpool itself, by reason", ["reason"], registry=r)
        self.redis_errors = Counter("sandpool_redis_errors_total", "Redis calls that failed", ["service"],
                                    registry=r)

    def observe(self, operation: str, status: int, seconds: float) -> None:
        self.requests.labels(SERVICE, operation, str(status)).inc()
        self.request_duration.labels(SERVICE, operation).observe(seconds)

    def redis_error(self) -> None:
        self.redis_errors.labels(SERVICE).inc()
