"""The pool controller's Prometheus metrics (names fixed in `docs/architecture.md`).

The scheduler owns the registry its `/metrics` serves and already defines these
three metrics in it (`SchedulerMetrics`); the controller is handed them with
`ControllerMetrics.from_scheduler(...)`. Used on its own (tests, tools), the
controller makes them in a private registry, so two controllers in one process
never collide. Pool gauges are the scheduler's, read from Redis at scrape time.
Labels are closed sets: pool names from the operator's configuration, never ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram


@dataclass(frozen=True)
class ControllerMetrics:
    sandbox_start: Histogram  # sandpool_sandbox_start_seconds{pool}
    reconciled: Counter  # sandpool_reconciled_total{kind: orphan_sandbox|stale_record|stuck_starting}
    provider_errors: Counter  # sandpool_provider_errors_total{provider, operation: create|destroy|list}

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ControllerMetrics:
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        return cls(
            sandbox_start=Histogram(
                "sandpool_sandbox_start_seconds", "Time from create to ready", ["pool"],
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=registry),
            reconciled=Counter("sandpool_reconciled_total", "Reconciliation fixes", ["kind"], registry=registry),
            provider_errors=Counter("sandpool_provider_errors_total", "Provider calls that failed",
                                    ["provider", "operation"], registry=registry),
        )

    @classmethod
    def from_scheduler(cls, scheduler_metrics: Any) -> ControllerMetrics:
        """Share the scheduler's metric objects (`SchedulerMetrics`), so its /metrics shows them."""
        return cls(sandbox_start=scheduler_metrics.sandbox_start, reconciled=scheduler_metrics.reconciled,
                   provider_errors=scheduler_metrics.provider_errors)
