"""The chart's `pools` values are the pools file's fields: checked against the one declaration.

A pool's fields are declared once, in `pool/templates.py` (common) and in each registered
provider's pool options (`providers.registry`); the chart's schema spells them in camelCase
and its `sandpool.poolsFile` helper writes them back as the file's keys. These tests fail
when a field is added on one side only, or a bound differs. With helm, every value is also
rendered and read back through the real loader.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml
from chart_support import CHART, find

from sandpool.controller.templates import POOL_NAME, parse_pools, pool_model

CHART_SPELLING = {"runtimeClassName": "runtime_class", "nodeSelector": "node_selector",
                  "workspaceSize": "workspace_size", "maxWarm": "max_warm"}
NOT_IN_CHART = {"command": "the chart's pods run the image's own agent command"}


def chart_pool_properties() -> dict[str, Any]:
    schema = json.loads((CHART / "values.schema.json").read_text())
    properties: dict[str, Any] = schema["properties"]["pools"]["items"]["properties"]
    return properties


def minimum_of(field: str) -> int | None:
    for bound in pool_model().model_fields[field].metadata:
        if hasattr(bound, "ge"):
            return int(bound.ge)
    return None


def test_the_chart_offers_every_pool_field_and_no_other() -> None:
    in_chart = {CHART_SPELLING.get(key, key) for key in chart_pool_properties()}
    declared = set(pool_model().model_fields) - set(NOT_IN_CHART)
    assert in_chart == declared


def test_the_chart_bounds_are_the_declared_ones() -> None:
    chart = chart_pool_properties()
    for key, spec in chart.items():
        if spec.get("type") == "integer":
            assert spec.get("minimum") == minimum_of(CHART_SPELLING.get(key, key)), key
    assert chart["name"]["pattern"] == POOL_NAME.pattern


def test_the_helper_writes_every_chart_key_as_the_file_key() -> None:
    helper = (CHART / "templates" / "_helpers.tpl").read_text()
    body = helper[helper.index('define "sandpool.poolsFile"'):]
    body = body[:body.index("{{- end -}}")]
    for key in chart_pool_properties():
        if key == "egress":  # removed: refused at render time, never written
            continue
        assert re.search(rf"\.{key}\b", body), f"the helper never reads pools[].{key}"
        assert f"{CHART_SPELLING.get(key, key)}:" in body, f"the helper never writes {CHART_SPELLING.get(key, key)}"


def test_every_pool_value_reaches_the_loader_through_the_chart(helm) -> None:
    objs = helm.render(sets=(
        "pools[0].name=full", "pools[0].image=registry.example/sandbox:1", "pools[0].warm=1",
        "pools[0].maxWarm=3", "pools[0].ceiling=5", "pools[0].runtimeClassName=gvisor",
        "pools[0].nodeSelector.zone=a", "pools[0].workspaceSize=2Gi",
        "pools[0].tolerations[0].key=k", "pools[0].tolerations[0].value=v",
        "pools[0].tolerations[0].effect=NoSchedule",
        "pools[0].resources.requests.cpu=250m", "pools[0].resources.limits.memory=1Gi",
        "pools[0].args[0]=--max-output-bytes"))
    data = yaml.safe_load(find(objs, "ConfigMap", "pools")["data"]["pools.yaml"])
    (pool,) = parse_pools(data, source="the chart's pools.yaml")
    options = pool.options["kubernetes"]
    assert (pool.name, pool.image, pool.warm, pool.max_warm, pool.ceiling, pool.runtime_class) == (
        "full", "registry.example/sandbox:1", 1, 3, 5, "gvisor")
    assert (pool.cpu_request, pool.memory, pool.args) == ("250m", "1Gi", ("--max-output-bytes",))
    assert options.node_selector == {"zone": "a"} and options.workspace_size == "2Gi"
    assert [t.as_api() for t in options.tolerations] == [
        {"operator": "Equal", "key": "k", "value": "v", "effect": "NoSchedule"}]
