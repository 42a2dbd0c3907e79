"""The pools file: every template field reaches the PoolSpec; every bad field is named."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path

import pytest

from sandpool.controller.provider import PoolSpec
from sandpool.controller.templates import load_pools, parse_pools, parse_quantity
from sandpool.core.settings import ConfigurationError
from sandpool.providers.kubernetes.pool_options import KubernetesPoolOptions, Toleration
from sandpool.providers.local.pool_options import LocalPoolOptions
from sandpool.providers.simulated.pool_options import SimulatedPoolOptions

REPO = Path(__file__).resolve().parents[2]

FULL = """
pools:
  - name: python
    image: registry.example/sandbox:1
    command: [/opt/venv/bin/sandpool, agent]
    args: [--extra, "1"]
    resources:
      requests: {cpu: 250m, memory: 256Mi}
      limits: {cpu: 1, memory: 1Gi}
    warm: 3
    ceiling: 9
    runtime_class: gvisor
    node_selector: {sandpool.dev/sandbox: "true"}
    tolerations:
      - {key: sandpool.dev/sandbox, operator: Equal, value: "true", effect: NoSchedule}
      - {operator: Exists, effect: NoExecute, tolerationSeconds: 30}
    workspace_size: 2Gi
    egress: false
  - name: small
    image: registry.example/small:2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pools.yaml"
    path.write_text(text)
    return path


def test_full_template_becomes_the_exact_pool_spec(tmp_path: Path) -> None:
    pools = load_pools(write(tmp_path, FULL))
    assert pools == [
        PoolSpec(
            name="python", image="registry.example/sandbox:1", warm=3, ceiling=9, cpu="1", memory="1Gi",
            cpu_request="250m", memory_request="256Mi",
            runtime_class="gvisor", command=("/opt/venv/bin/sandpool", "agent"), args=("--extra", "1"),
            options={"local": LocalPoolOptions(), "kubernetes": KubernetesPoolOptions(
                node_selector={"sandpool.dev/sandbox": "true"},
                tolerations=[
                    Toleration(key="sandpool.dev/sandbox", operator="Equal", value="true", effect="NoSchedule"),
                    Toleration(operator="Exists", effect="NoExecute", tolerationSeconds=30),
                ],
                workspace_size="2Gi",
            ), "simulated": SimulatedPoolOptions()},
        ),
        PoolSpec(
            name="small", image="registry.example/small:2", warm=2, ceiling=16,
            options={"local": LocalPoolOptions(), "kubernetes": KubernetesPoolOptions(),
                     "simulated": SimulatedPoolOptions()},
        ),
    ]
    # The Kubernetes provider reads its options as they are (typed, no second validation).
    assert [t.as_api() for t in pools[0].options["kubernetes"].tolerations] == [
        {"operator": "Equal", "key": "sandpool.dev/sandbox", "value": "true", "effect": "NoSchedule"},
        {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
    ]


@pytest.mark.parametrize("name", ["default.yaml", "gvisor.yaml"])
def test_shipped_examples_load(name: str) -> None:
    pools = load_pools(REPO / "deploy" / "pools" / name)
    assert pools and all(p.warm <= p.ceiling for p in pools)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pools:\n  - {name: a, image: i, warm: 5, ceiling: 2}", "pools[0]: warm (5) is above ceiling (2)"),
        ("pools:\n  - {name: Bad_Name, image: i}", "pools[0].name: 'Bad_Name' must be"),
        ("pools:\n  - {name: a}", "pools[0].image: Field required"),
        ("pools:\n  - {name: a, image: 'a b'}", "pools[0].image: an image reference contains no whitespace"),
        ("pools:\n  - {name: a, image: i}\n  - {name: a, image: j}", "pool name 'a' appears twice"),
        ("pools:\n  - {name: a, image: i, resources: {limits: {memory: 1Gb}}}",
         "pools[0].resources.limits.memory: '1Gb' is not a Kubernetes quantity"),
        ("pools:\n  - {name: a, image: i, resources: {requests: {cpu: 2}, limits: {cpu: 500m}}}",
         "pools[0].resources: requests.cpu (2) is above limits.cpu (500m)"),
        ("pools:\n  - {name: a, image: i, resources: {limits: {cpu: 0}}}",
         "pools[0].resources.limits.cpu: '0' must be"),
        ("pools:\n  - {name: a, image: i, runtimeClassName: gvisor}", "pools[0].runtimeClassName: Extra inputs"),
        ("pools:\n  - {name: a, image: i, warm: -1}", "pools[0].warm: Input should be greater than or equal to 0"),
        ("pools:\n  - {name: a, image: i, ceiling: 0}", "pools[0].ceiling: Input should be greater than or equal to 1"),
        ("pools:\n  - {name: a, image: i, node_selector: {zone: true}}",
         "pools[0].node_selector.zone: Input should be"),
        ("pools:\n  - {name: a, image: i, node_selector: {'bad key!': x}}", "'bad key!' is not a label key"),
        ("pools:\n  - {name: a, image: i, tolerations: [{operator: Exists, value: x}]}",
         "pools[0].tolerations[0]: a toleration with operator Exists takes no value"),
        ("pools:\n  - {name: a, image: i, tolerations: [{key: k, effect: NoSchedule, tolerationSeconds: 5}]}",
         "toleration_seconds applies only to effect NoExecute"),
        ("pools:\n  - {name: a, image: i, tolerations: [{key: k, effect: Sometimes}]}",
         "pools[0].tolerations[0].effect"),
        ("pools:\n  - {name: a, image: i, workspace_size: lots}",
         "pools[0].workspace_size: 'lots' is not a Kubernetes"),
        ("pools:\n  - {name: a, image: i, command: ['']}", "pools[0].command: every word must be"),
        ("pools:\n  - {name: a, image: i, runtime_class: 'G Visor'}", "pools[0].runtime_class: 'G Visor' is not"),
        ("pools:\n  - {name: a, image: i, egress: maybe}", "pools[0].egress: Input should be a valid boolean"),
        ("pools:\n  - {name: a, image: i, egress: true}", "pools[0].egress: a pool no longer opens egress"),
        ("pools: []", "pools: List should have at least 1 item"),
        ("pool:\n  - {name: a, image: i}", "pool: Extra inputs are not permitted"),
        ("- {name: a, image: i}", "(top level): Input should be a valid dictionary"),
    ],
)
def test_bad_field_is_named(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigurationError) as info:
        load_pools(path)
    message = str(info.value)
    assert str(path) in message
    assert expected in message


def test_unreadable_empty_and_broken_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="cannot read pools file"):
        load_pools(tmp_path / "missing.yaml")
    with pytest.raises(ConfigurationError, match="is empty"):
        load_pools(write(tmp_path, "# nothing\n"))
    with pytest.raises(ConfigurationError, match=r"at line 3, column 1"):
        load_pools(write(tmp_path, "pools:\n  - {name: a, image: [\n"))
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00pools")
    with pytest.raises(ConfigurationError, match="not UTF-8"):
        load_pools(tmp_path / "bin.yaml")


def test_parse_pools_accepts_parsed_data_and_reports_every_error() -> None:
    with pytest.raises(ConfigurationError) as info:
        parse_pools({"pools": [{"name": "a"}, {"image": "x"}]}, source="inline")
    message = str(info.value)
    assert message.startswith("inline: invalid pools:")
    assert "pools[0].image: Field required" in message and "pools[1].name: Field required" in message


@pytest.mark.parametrize(
    ("text", "value"),
    [("250m", Decimal("0.25")), ("2", Decimal(2)), ("1Gi", Decimal(2**30)), ("1.5G", Decimal("1.5e9")),
     ("128974848", Decimal(128974848)), ("129e6", Decimal("129e6")), ("123Mi", Decimal(123 * 2**20))],
)
def test_parse_quantity(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "1Gb", "-1", "1 Gi", "Gi", "0x10"])
def test_parse_quantity_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)
