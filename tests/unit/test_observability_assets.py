"""The Grafana dashboard and the Prometheus alerts speak the metric names fixed in docs/architecture.md.

The architecture's Metrics table is the source of truth: every metric either
asset references must be in it (a histogram may be read through its `_bucket`,
`_sum` and `_count` series), every label a query selects or groups on must be
one of that metric's labels, a literal label value must be in the table's closed
set where it lists one, and every metric of the table must be on the dashboard.
The table itself is checked against what the two processes register: the api's
`ApiMetrics` and the controller's `ControllerMetrics` (same names, same labels), and
the `service` label takes the two processes' names only (`api`, `controller`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
DASHBOARD = ROOT / "deploy" / "grafana" / "sandpool.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yaml"

METRIC_RE = re.compile(r"\bsandpool_[a-z0-9_]+\b")
SELECTOR_RE = re.compile(r"\b(sandpool_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER_RE = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
GROUPING_RE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


@dataclass(frozen=True)
class Metric:
    name: str
    type: str
    labels: dict[str, frozenset[str] | None]  # label -> closed set of values, when the table lists one
    unlabelled: bool = False  # the table says `none`: one series (a histogram's buckets aside)


def parse_metrics_table(markdown: str) -> dict[str, Metric]:
    """The rows of the table under the `### Metrics` heading of docs/architecture.md."""
    section = markdown.split("### Metrics", 1)[1]
    metrics: dict[str, Metric] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`sandpool_"):
            if metrics and not line.strip().startswith("|"):
                break  # the table ended
            continue
        name = cells[0].strip("`")
        labels: dict[str, frozenset[str] | None] = {}
        # "`outcome` (`granted`, `capacity`, `quota`)" -> outcome: {granted, capacity, quota}
        for label, values in re.findall(r"`([a-z_]+)`(?:\s*\(([^)]*)\))?", cells[2]):
            labels[label] = frozenset(re.findall(r"`([^`]+)`", values)) if values else None
        metrics[name] = Metric(name, cells[1], labels, unlabelled=cells[2] == "none")
    return metrics


def services() -> frozenset[str]:
    """The values of the `service` label: what each process puts there."""
    from sandpool.controller.metrics import SERVICE as CONTROLLER
    from sandpool.sessions.metrics import SERVICE as API

    return frozenset({API, CONTROLLER})


@pytest.fixture(scope="module")
def table() -> dict[str, Metric]:
    """The documented table; `service` closed to the processes' names (where the table lists none)."""
    metrics = parse_metrics_table(ARCHITECTURE.read_text())
    for metric in metrics.values():
        if "service" in metric.labels and metric.labels["service"] is None:
            metric.labels["service"] = services()
    return metrics


def registered() -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (type, label names) of every metric the api and the controller register."""
    from sandpool.controller.metrics import ControllerMetrics
    from sandpool.sessions.metrics import ApiMetrics

    found: dict[str, tuple[str, frozenset[str]]] = {}
    for registry in (ApiMetrics().registry, ControllerMetrics.create().registry):
        for collector in list(registry._collector_to_names):  # prometheus_client: no public list of collectors
            name = collector._name  # type: ignore[attr-defined]  # every metric class has one
            kind = collector._type  # type: ignore[attr-defined]
            labels = frozenset(collector._labelnames)  # type: ignore[attr-defined]
            if kind == "counter":
                name += "_total"
            assert found.get(name, (kind, labels)) == (kind, labels), f"{name}: the two processes disagree"
            found[name] = (kind, labels)
    return found


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def alert_rules(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [rule for group in doc["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def alerts() -> dict[str, Any]:
    return yaml.safe_load(ALERTS.read_text())


def base_name(name: str, table: dict[str, Metric]) -> str:
    if name in table:
        return name
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and base in table and table[base].type == "histogram":
            return base
    return name


def problems_in(expr: str, table: dict[str, Metric]) -> list[str]:
    """Unknown metrics, unknown labels and out-of-set label values in one PromQL expression."""
    found = []
    referenced = {base_name(m, table) for m in METRIC_RE.findall(expr)}
    found += [f"unknown metric {m}" for m in sorted(referenced - table.keys())]
    for raw_name, matchers in SELECTOR_RE.findall(expr):
        metric = table.get(base_name(raw_name, table))
        if metric is None:
            continue
        allowed = set(metric.labels) | ({"le"} if raw_name.endswith("_bucket") else set())
        for label, op, value in MATCHER_RE.findall(matchers):
            if label not in allowed:
                found.append(f"{raw_name} has no label {label!r}")
                continue
            closed = metric.labels.get(label)
            if closed and op in ("=", "=~") and re.fullmatch(r"[A-Za-z0-9_|]+", value):
                found += [f"{raw_name}{{{label}}} has no value {v!r}" for v in value.split("|") if v not in closed]
    known_labels = {"le"} | {label for m in referenced if m in table for label in table[m].labels}
    for group in GROUPING_RE.findall(expr):
        for label in filter(None, (g.strip() for g in group.split(","))):
            if label not in known_labels:
                found.append(f"grouping on {label!r}, which none of {sorted(referenced)} has")
    return found


def balanced(text: str) -> bool:
    pairs = {")": "(", "}": "{", "]": "["}
    stack: list[str] = []
    in_string = False
    for ch in text:
        if ch == '"':
            in_string = not in_string
        elif in_string:
            continue
        elif ch in "({[":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack and not in_string


# --- the table itself ------------------------------------------------------------------------------


def test_the_metrics_table_parses(table: dict[str, Metric]) -> None:
    assert len(table) >= 13
    outcomes = frozenset({"granted", "capacity", "quota", "start_timeout"})
    assert table["sandpool_leases_total"].labels == {"outcome": outcomes}
    assert set(table["sandpool_requests_total"].labels) == {"service", "operation", "status"}
    assert table["sandpool_sandbox_start_seconds"].type == "histogram"
    for metric in table.values():
        assert metric.type in ("counter", "gauge", "histogram"), metric
        assert bool(metric.labels) != metric.unlabelled, f"{metric.name}: no labels parsed, nor `none`"
        assert not metric.type == "counter" or metric.name.endswith("_total"), metric.name


def test_the_table_is_what_the_api_and_the_controller_register(table: dict[str, Metric]) -> None:
    code = registered()
    assert sorted(code.keys() - table.keys()) == [], "registered but not documented"
    assert sorted(table.keys() - code.keys()) == [], "documented but registered by neither process"
    for name, (kind, labels) in code.items():
        assert table[name].type == kind, (name, table[name].type, kind)
        assert set(table[name].labels) == labels, (name, sorted(table[name].labels), sorted(labels))


def test_the_service_label_names_the_two_processes(table: dict[str, Metric]) -> None:
    assert services() == {"api", "controller"}
    for metric in table.values():
        if "service" in metric.labels:
            assert metric.labels["service"] == services(), (metric.name, metric.labels["service"])


def test_the_checker_catches_what_it_should(table: dict[str, Metric]) -> None:
    # Guards against a checker that passes everything.
    assert problems_in('rate(sandpool_leases_total{outcome="granted"}[5m])', table) == []
    assert problems_in("sandpool_nope_total", table) == ["unknown metric sandpool_nope_total"]
    assert problems_in('sandpool_leases_total{pool="a"}', table) == ["sandpool_leases_total has no label 'pool'"]
    assert problems_in('sandpool_leases_total{outcome=~"granted|nope"}', table) == [
        "sandpool_leases_total{outcome} has no value 'nope'"]
    assert problems_in("sum by (workspace) (sandpool_leases_total)", table)
    assert problems_in("sandpool_leases_total_bucket", table)  # a counter has no buckets
    assert problems_in('sandpool_redis_errors_total{service="api"}', table) == []
    assert problems_in('sandpool_requests_total{service="proxy"}', table) == [
        "sandpool_requests_total{service} has no value 'proxy'"]
    assert problems_in('sandpool_redis_errors_total{service=~"scheduler|controller"}', table) == [
        "sandpool_redis_errors_total{service} has no value 'scheduler'"]
    assert problems_in('histogram_quantile(0.5, sum by (le) (rate(sandpool_sandbox_start_seconds_bucket[5m])))',
                       table) == []


# --- dashboard -------------------------------------------------------------------------------------


def test_dashboard_references_only_documented_metrics_labels_and_values(dashboard: dict[str, Any],
                                                                        table: dict[str, Metric]) -> None:
    problems = [f"{expr!r}: {p}" for expr in dashboard_exprs(dashboard) for p in problems_in(expr, table)]
    assert problems == []


def test_every_documented_metric_is_on_the_dashboard(dashboard: dict[str, Any], table: dict[str, Metric]) -> None:
    shown = {base_name(m, table) for expr in dashboard_exprs(dashboard) for m in METRIC_RE.findall(expr)}
    assert sorted(table.keys() - shown) == []


def test_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and panel.get("description"), panel["title"]
        for target in panel["targets"]:
            assert METRIC_RE.search(target["expr"]) and balanced(target["expr"]), target["expr"]
            assert target["datasource"]["uid"] == "${datasource}"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    used = set(re.findall(r"\$([a-z_]+)", json.dumps(dashboard["panels"]))) - {"__rate_interval"}
    assert used <= variables, f"panels use undefined variables {used - variables}"


# --- alerts ----------------------------------------------------------------------------------------


def test_alerts_reference_only_documented_metrics_labels_and_values(alerts: dict[str, Any],
                                                                    table: dict[str, Metric]) -> None:
    problems = [f"{rule['alert']}: {p}" for rule in alert_rules(alerts) for p in problems_in(rule["expr"], table)]
    assert problems == []


def test_alert_file_is_well_formed(alerts: dict[str, Any]) -> None:
    assert set(alerts) == {"groups"} and alerts["groups"]
    group_names = [g["name"] for g in alerts["groups"]]
    assert len(group_names) == len(set(group_names))
    names = []
    for group in alerts["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"], group["name"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule
            assert re.fullmatch(r"Sandpool[A-Z][A-Za-z]+", rule["alert"]), rule["alert"]
            names.append(rule["alert"])
            assert isinstance(rule["expr"], str) and METRIC_RE.search(rule["expr"]) and balanced(rule["expr"])
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["for"]
            assert rule["labels"]["severity"] in ("critical", "warning", "info")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            for text in rule["annotations"].values():
                assert text.count("{{") == text.count("}}"), text
                # $labels.X in a message must be a label the alert's series carry.
                for label in re.findall(r"\$labels\.([a-z_]+)", text):
                    assert re.search(rf"\b(by|on)\s*\([^)]*\b{label}\b", rule["expr"]), (rule["alert"], label)
    assert len(names) == len(set(names)), "duplicate alert names"


def test_the_alerts_the_operators_need_exist(alerts: dict[str, Any]) -> None:
    by_metric: dict[str, list[str]] = {}
    for rule in alert_rules(alerts):
        for metric in set(METRIC_RE.findall(rule["expr"])):
            by_metric.setdefault(metric, []).append(rule["alert"])
    dry = next(r for r in alert_rules(alerts) if r["alert"] == "SandpoolPoolDry")
    assert 'state="ready"' in dry["expr"] and "== 0" in dry["expr"] and dry["for"] == "2m"
    for metric in ("sandpool_leases_total", "sandpool_reconciled_total", "sandpool_requests_total",
                   "sandpool_redis_errors_total", "sandpool_provider_errors_total"):
        assert metric in by_metric, f"no alert on {metric}"
    leaked = [r for r in alert_rules(alerts) if 'kind="orphan_sandbox"' in r["expr"]]
    assert leaked and "increase(" in leaked[0]["expr"]
