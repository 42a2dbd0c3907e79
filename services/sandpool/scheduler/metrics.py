"""The scheduler's Prometheus metrics (names fixed in docs/architecture.md).

One registry per app, so two apps in one process (tests, a replica and its
controller) never collide. Labels are closed sets only: never a session,
sandbox or workspace id. Pool gauges are read from Redis at scrape time, so
every replica reports the same figures.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sandpool.contract.agent_protocol import Outcome
from sandpool.pool.metrics import ControllerMetrics

SERVICE = "scheduler"
OPERATIONS = ("CreateSession", "Execute", "DestroySession", "ListFiles", "GetFile", "PutFile")
EXEC_OUTCOMES = tuple(Outcome)
"""The `outcome` labels of `sandpool_executions_total`: the agent's outcome labels."""

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class SchedulerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("sandpool_requests_total", "Contract requests served",
                                ["service", "operation", "status"], registry=r)
        self.request_duration = Histogram("sandpool_request_duration_seconds", "Contract request latency",
                                          ["service", "operation"], buckets=_LATENCY_BUCKETS, registry=r)
        self.leases = Counter("sandpool_leases_total", "CreateSession outcomes", ["outcome"], registry=r)
        self.pool_sandboxes = Gauge("sandpool_pool_sandboxes", "Sandboxes of a pool by state (from Redis)",
                                    ["pool", "state"], registry=r)
        self.pool_ceiling = Gauge("sandpool_pool_ceiling", "Most sandboxes a pool may have", ["pool"], registry=r)
        self.executions = Counter("sandpool_executions_total", "Exec calls that ran, by outcome",
                                  ["tool", "outcome"], registry=r)
        self.execution_duration = Histogram("sandpool_execution_duration_seconds",
                                            "Exec call time (scheduler's clock)", ["tool"],
                                            buckets=_LATENCY_BUCKETS, registry=r)
        self.reaped = Counter("sandpool_sessions_reaped_total", "Sessions released by the scheduler itself",
                              ["reason"], registry=r)
        self.redis_errors = Counter("sandpool_redis_errors_total", "Redis calls that failed", ["service"],
                                    registry=r)
        # Owned by the pool controller running inside the scheduler process.
        self.controller = ControllerMetrics.create(r)
        self.sandbox_start = self.controller.sandbox_start
        self.reconciled = self.controller.reconciled
        self.provider_errors = self.controller.provider_errors
