"""The pool controller's Prometheus metrics (names fixed in `docs/architecture.md`).

`sandpool controller` serves them on its own `/metrics`; used on its own
(tests, tools), the controller makes them in a private registry, so two
controllers in one process never collide. The warm-target gauges are set by the
leading controller only; the pool sandbox gauges are read from Redis at scrape
time, so every replica reports the same figures.
Labels are closed sets: pool names from the operator's configuration, never ids.

`sandpool_reconciled_total{kind}` counts what the controller put right: sandboxes
the provider runs that Redis does not know (`orphan_sandbox`), records of sandboxes
the provider does not run (`stale_record`), starts abandoned (`stuck_starting`),
sandboxes leased to a session that is gone (`sessionless_lease`), ready sandboxes
above a lowered target or two leaders' overlapping starts (`surplus_ready`),
sandboxes the provider reports dead (`lost`), and waiters whose api replica
vanished (`stale_waiter`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SERVICE = "controller"


@dataclass(frozen=True)
class ControllerMetrics:
    sandbox_start: Histogram  # sandpool_sandbox_start_seconds{pool}
    # sandpool_reconciled_total{kind: orphan_sandbox|stale_record|stuck_starting|sessionless_lease|
    #                                 surplus_ready|lost|stale_waiter}
    reconciled: Counter
    reconcile_pass: Histogram  # sandpool_reconcile_pass_seconds: wall time of a whole reconciliation pass
    provider_errors: Counter  # sandpool_provider_errors_total{provider, operation: create|destroy|list}
    pool_target: Gauge  # sandpool_pool_target{pool}: the warm target the controller chose
    pool_lease_rate: Gauge  # sandpool_pool_lease_rate{pool}: leases per second over the last minute
    pool_start_estimate: Gauge  # sandpool_pool_start_seconds_estimate{pool}: the start time it assumes
    pool_sandboxes: Gauge  # sandpool_pool_sandboxes{pool, state}: read from Redis at scrape time
    pool_ceiling: Gauge  # sandpool_pool_ceiling{pool}
    reaped: Counter  # sandpool_sessions_reaped_total{reason}: sessions the session reaper released
    unconfirmed_calls: Counter  # sandpool_unconfirmed_calls_total{kind: execution|file}: overdue calls settled
    redis_errors: Counter  # sandpool_redis_errors_total{service="controller"}
    registry: CollectorRegistry

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ControllerMetrics:
        registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        return cls(
            sandbox_start=Histogram(
                "sandpool_sandbox_start_seconds", "Time from create to ready", ["pool"],
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120), registry=registry),
            reconciled=Counter("sandpool_reconciled_total",
                               "Reconciliation fixes by kind: orphan_sandbox, stale_record, stuck_starting, "
                               "sessionless_lease, surplus_ready, lost, stale_waiter", ["kind"], registry=registry),
            reconcile_pass=Histogram(
                "sandpool_reconcile_pass_seconds", "Wall time of one whole reconciliation pass (it grows with the "
                "sandboxes the pools own)", buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60), registry=registry),
            provider_errors=Counter("sandpool_provider_errors_total", "Provider calls that failed",
                                    ["provider", "operation"], registry=registry),
            pool_target=Gauge("sandpool_pool_target", "Sandboxes the controller keeps ready (its warm target)",
                              ["pool"], registry=registry),
            pool_lease_rate=Gauge("sandpool_pool_lease_rate", "Leases per second over the last minute",
                                  ["pool"], registry=registry),
            pool_start_estimate=Gauge("sandpool_pool_start_seconds_estimate",
                                      "Start time the warm target assumes (moving estimate)", ["pool"],
                                      registry=registry),
            pool_sandboxes=Gauge("sandpool_pool_sandboxes", "Sandboxes of a pool by state (from Redis)",
                                 ["pool", "state"], registry=registry),
            pool_ceiling=Gauge("sandpool_pool_ceiling", "Most sandboxes a pool may have", ["pool"],
                               registry=registry),
            reaped=Counter("sandpool_sessions_reaped_total", "Sessions released by sandpool itself, by reason",
                           ["reason"], registry=registry),
            unconfirmed_calls=Counter("sandpool_unconfirmed_calls_total",
                                      "Calls whose done never came (their api crashed), settled from their record",
                                      ["kind"], registry=registry),
            redis_errors=Counter("sandpool_redis_errors_total", "Redis calls that failed", ["service"],
                                 registry=registry),
            registry=registry,
        )

    def redis_error(self) -> None:
        self.redis_errors.labels(SERVICE).inc()
