"""The proxy's Prometheus metrics, on a registry of each app's own (two apps in one process never clash).

Label values are closed sets: operation names below, status codes, auth refusal
reasons from `auth.REASONS`. Never a workspace, session or token.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

SERVICE = "proxy"


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("sandpool_requests_total", "Requests served, by operation and status",
                                ["service", "operation", "status"], registry=self.registry)
        self.duration = Histogram("sandpool_request_duration_seconds", "Time to the response head, by operation",
                                  ["service", "operation"], registry=self.registry,
                                  buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                           2.5, 5, 10, 30, 60))
        self.auth_failures = Counter("sandpool_auth_failures_total", "Refused credentials, by reason",
                                     ["reason"], registry=self.registry)
        self.redis_errors = Counter("sandpool_redis_errors_total", "Redis calls that failed",
                                    ["service"], registry=self.registry)

    def observe(self, operation: str, status: int, seconds: float) -> None:
        self.requests.labels(SERVICE, operation, str(status)).inc()
        self.duration.labels(SERVICE, operation).observe(seconds)

    def redis_error(self) -> None:
        self.redis_errors.labels(SERVICE).inc()
