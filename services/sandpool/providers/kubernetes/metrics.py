"""The provider's own counters as Prometheus metrics, read from the provider at scrape time.

What the provider sees of the API server (calls, retries, 429s, 5xx, connection
errors, watch lists and 410s) and of its sandboxes (created, failed creates,
destroyed, lost) belongs where rates and alerts are made: the controller's
`/metrics` (see docs/kubernetes.md). The counters live in the provider
(`ApiStats`, `PodWatcher`, `counts`); this collector only reads them, so there is
no second bookkeeping to drift. Labels are closed sets (operation names, kinds).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandpool.providers.kubernetes.client import ApiStats
from sandpool.providers.kubernetes.watch import PodWatcher

SANDBOX_EVENTS = ("created", "create_failed", "destroyed", "lost")


class KubernetesProviderCollector(Collector):
    """Reads the provider's API statistics, its pod watch and its sandbox counts (the objects themselves,
    which the provider keeps for its lifetime and updates in place) at each scrape."""

    def __init__(self, stats: ApiStats, watcher: PodWatcher, counts: Mapping[str, int]) -> None:
        self.stats = stats
        self.watcher = watcher
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        watcher = self.watcher
        calls = CounterMetricFamily("sandpool_kube_api_calls", "Kubernetes API requests sent, by operation",
                                    labels=["operation"])
        for operation, count in sorted(stats.by_operation.items()):
            calls.add_metric([operation], count)
        yield calls
        yield CounterMetricFamily("sandpool_kube_api_retries", "Kubernetes API calls retried after a failure",
                                  value=stats.retries)
        failures = CounterMetricFamily("sandpool_kube_api_failures", "Kubernetes API answers that were failures",
                                       labels=["kind"])
        for kind, count in (("throttled", stats.throttled), ("server_error", stats.server_errors),
                            ("connection", stats.connection_errors), ("conflict", stats.conflicts)):
            failures.add_metric([kind], count)
        yield failures
        yield CounterMetricFamily("sandpool_kube_watch_requests", "Pod watch requests made (each resumes the last)",
                                  value=watcher.watch_requests)
        yield CounterMetricFamily("sandpool_kube_watch_lists", "Full lists of the installation's pods",
                                  value=watcher.relists)
        yield CounterMetricFamily("sandpool_kube_watch_expired", "Watch resumptions answered 410 Gone",
                                  value=watcher.expired)
        yield GaugeMetricFamily("sandpool_kube_watched_pods", "Pods of the installation the watch knows",
                                value=len(watcher.pods))
        sandboxes = CounterMetricFamily("sandpool_kube_sandboxes", "Sandbox pods by what happened to them",
                                        labels=["event"])
        for event in SANDBOX_EVENTS:
            sandboxes.add_metric([event], self.counts.get(event, 0))
        yield sandboxes
        yield CounterMetricFamily("sandpool_kube_delete_calls", "Delete requests sent (each up to 50 pods)",
                                  value=self.counts.get("delete_calls", 0))
