"""The live api's and controller's /metrics carry the names and labels the dashboard and alerts query.

The static check (tests/unit/test_observability_assets.py) holds the assets to
docs/architecture.md; this one holds the running services of a `sandpool up` to
the same table, so a renamed metric or label breaks a test rather than a dashboard.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from client_stack import Stack
from prometheus_client.parser import text_string_to_metric_families

from sandpool.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_observability_assets import ARCHITECTURE, parse_metrics_table

pytestmark = pytest.mark.timeout(60)


def test_api_metrics_match_the_architecture_table(stack: Stack) -> None:
    with Client(stack.url, max_retries=20, max_retry_wait=30) as client, client.session() as s:
        s.run_python("print(1)")  # so the per-call series exist
    assert problems_of(stack.url, "api") == []


def test_controller_metrics_match_the_architecture_table(stack: Stack) -> None:
    """The controller `sandpool up` runs answers on a Unix socket in the directory up records in its run dir."""
    record = stack.data_dir / "run" / "sockets-dir"
    if not record.exists():
        pytest.skip("not a stack this test started: its controller's socket is not known")
    socket_path = Path(record.read_text().strip()) / "controller.sock"
    assert problems_of("http://controller", "controller", transport=httpx.HTTPTransport(uds=str(socket_path))) == []


def problems_of(url: str, service: str, *, transport: httpx.HTTPTransport | None = None) -> list[str]:
    """What the live /metrics of `service` gets wrong against the table's rows for that service."""
    with httpx.Client(transport=transport, timeout=10) as client:
        text = client.get(f"{url}/metrics").text
    live = {family.name: family for family in text_string_to_metric_families(text)}
    table = parse_metrics_table(ARCHITECTURE.read_text())
    mine = {name: m for name, m in table.items() if service in _where(name)}
    assert mine, f"the table names no metric of the {service}"
    problems = []
    for name, metric in mine.items():
        family = live.get(name.removesuffix("_total"))  # the parser names counters without _total
        if family is None:
            problems.append(f"{name} is not exposed")
            continue
        if family.type != metric.type:
            problems.append(f"{name} is a {family.type}, the table says {metric.type}")
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}
            if labels and labels != set(metric.labels):
                problems.append(f"{sample.name} has labels {sorted(labels)}, the table says {sorted(metric.labels)}")
                break
            for label, closed in metric.labels.items():
                if closed and label in sample.labels and sample.labels[label] not in closed:
                    problems.append(f"{sample.name}{{{label}={sample.labels[label]!r}}} is outside {sorted(closed)}")
            if "service" in sample.labels and sample.labels["service"] != service:
                problems.append(f"{sample.name} says service={sample.labels['service']!r}")
    if "sandpool_requests_total" in mine and not any(
            smp.labels.get("operation") for smp in live["sandpool_requests"].samples):
        problems.append("no request was counted by operation")
    return problems


def _where(name: str) -> str:
    for line in ARCHITECTURE.read_text().splitlines():
        if line.startswith(f"| `{name}` |"):
            return line.rsplit("|", 2)[-2]
    return ""
