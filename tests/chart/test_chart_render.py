"""The chart lints, renders every scenario, and its output is valid Kubernetes.

Scenarios are `charts/sandpool/ci/*.yaml` (plus the defaults). Rendered
objects are checked against the Kubernetes 1.25, 1.31 and 1.35 OpenAPI schemas
shipped by `kubernetes-validate` (offline, strict: an unknown field is an error).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import CHART, SCENARIOS, Helm, HelmError, find, parse

DEFAULT_AND_SCENARIOS = [None, *SCENARIOS]
# The oldest version Chart.yaml admits (kubeVersion >=1.25) and a current one.
KUBERNETES_VERSIONS = ("1.25", "1.31", "1.35")


def _values(scenario: str | None) -> tuple[str, ...]:
    return () if scenario is None else (scenario,)


def test_scenarios_exist() -> None:
    assert {"external-redis-values.yaml", "ingress-tls-values.yaml", "gvisor-pools-values.yaml",
            "egress-values.yaml", "servicemonitor-hpa-values.yaml"} <= set(SCENARIOS)


def test_lint_strict_every_scenario(helm: Helm) -> None:
    for scenario in DEFAULT_AND_SCENARIOS:
        args = ["lint", "--strict", str(CHART)]
        if scenario:
            args += ["-f", str(CHART / "ci" / scenario)]
        proc = helm.run(*args, check=False)
        assert proc.returncode == 0, f"helm lint --strict {scenario or '(defaults)'}:\n{proc.stdout}{proc.stderr}"
        assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("scenario", DEFAULT_AND_SCENARIOS, ids=lambda s: s or "defaults")
def test_renders_valid_kubernetes(helm: Helm, scenario: str | None) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="KUBERNETES-VALIDATE MISSING: pip install -e '.[chart]'")
    objs = helm.render(*_values(scenario))
    assert objs, "nothing rendered"
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "NetworkPolicy", "Secret", "ConfigMap"} <= kinds
    names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(names) == len(set(names)), "two objects share a kind, namespace and name"
    for obj in objs:
        if obj["kind"] == "ServiceMonitor":  # a CRD: no upstream schema, checked by shape below
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert obj["spec"]["endpoints"] and obj["spec"]["selector"]
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} is not valid Kubernetes {version}: "
                            f"{exc.message}")


def test_validation_catches_a_mistyped_field(helm: Helm) -> None:
    """The offline validation is strict: one misspelt field in a rendered Deployment fails it."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="KUBERNETES-VALIDATE MISSING: pip install -e '.[chart]'")
    deployment = json.loads(json.dumps(find(helm.render(), "Deployment", "-api")))
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[0], strict=True)


def test_every_object_is_namespaced_and_labelled(helm: Helm) -> None:
    for scenario in DEFAULT_AND_SCENARIOS:
        for obj in helm.render(*_values(scenario)):
            meta = obj["metadata"]
            if obj["kind"] != "Namespace":
                assert meta.get("namespace"), f"{obj['kind']}/{meta['name']} has no namespace"
            assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
            assert meta["labels"]["app.kubernetes.io/instance"] == "sp"


# --- values.schema.json -------------------------------------------------------------------------


def _walk_schema(node: dict[str, Any], path: str) -> list[str]:
    problems = []
    if not node.get("description"):
        problems.append(f"{path}: no description")
    if node.get("type") == "object" and "properties" in node and node.get("additionalProperties") is not False:
        problems.append(f"{path}: object without additionalProperties: false")
    for name, child in node.get("properties", {}).items():
        problems += _walk_schema(child, f"{path}.{name}")
    items = node.get("items")
    if isinstance(items, dict) and items.get("type") == "object":
        problems += _walk_schema(items, f"{path}[]")
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and extra.get("type") == "object":
        problems += _walk_schema(extra, f"{path}.*")
    return problems


def test_schema_closed_and_described() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    assert _walk_schema(schema, "values") == []


def test_every_default_value_is_in_the_schema_and_commented() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        if isinstance(value, dict) and "properties" in node:
            for key, child in value.items():
                assert key in node["properties"], f"{path}.{key} is not in values.schema.json"
                walk(child, node["properties"][key], f"{path}.{key}")
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for item in value:
                walk(item, node["items"], f"{path}[]")

    walk(values, schema, "values")
    # Every leaf of values.yaml carries a `# --` description, or sits inside a block that has one
    # (resources.requests.cpu under a described `resources:`).
    described: list[tuple[int, bool]] = []  # (indent, described) of the enclosing blocks
    previous = ""
    for number, line in enumerate((CHART / "values.yaml").read_text().splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            previous = text or previous
            continue
        indent = len(line) - len(line.lstrip(" -"))
        while described and described[-1][0] >= indent:
            described.pop()
        key, _, rest = text.lstrip("- ").partition(":")
        mine = previous.startswith("# --") or any(d for _, d in described)
        if rest.strip():  # a leaf
            assert mine, f"values.yaml:{number} `{key}` has no `# --` description"
        else:
            described.append((indent, previous.startswith("# --")))
        previous = text


@pytest.mark.parametrize(("sets", "message"), [
    (("api.replicas=two",), "api.replicas: Invalid type"),
    (("api.replica=2",), "Additional property replica is not allowed"),
    (("controller.port=0",), "controller.port"),
    (("controller.provider=docker",), "controller.provider"),
    (("redis.mode=sentinel",), "redis.mode"),
    (("pools[0].name=Bad_Name",), "pools.0.name"),
    (("auth.generateSigningKey=maybe",), "auth.generateSigningKey"),
    (("egress.denyCidrs[0]=everywhere",), "egress.denyCidrs.0"),
    (("egress.allowCeiling[0]=a b",), "egress.allowCeiling.0"),
    (("egress.port=0",), "egress.port"),
])
def test_schema_rejects_mistyped_values(helm: Helm, sets: tuple[str, ...], message: str) -> None:
    with pytest.raises(HelmError) as err:
        helm.template_text(sets=sets)
    assert message in str(err.value)


@pytest.mark.parametrize(("values", "message"), [
    ({"redis": {"mode": "external"}}, "redis.mode=external needs redis.external.url"),
    ({"auth": {"generateSigningKey": False}}, "no token key"),
    ({"auth": {"existingSecret": "keys"}}, "auth.existingSecret needs auth.existingSecretKeyNames"),
    ({"pools": [{"name": "a", "warm": 1, "ceiling": 1}, {"name": "a", "warm": 1, "ceiling": 2}]},
     'the name "a" is used twice'),
    ({"pools": [{"name": "a", "warm": 20, "ceiling": 4}]}, "warm (20) is above ceiling (4)"),
    ({"sandboxes": {"createNamespace": True}}, "sandboxes.createNamespace needs sandboxes.namespace"),
    # The raw-CIDR egress of old: refused with the way to migrate, never silently dropped.
    ({"pools": [{"name": "web", "warm": 1, "ceiling": 2, "egress": True}]}, "pools[web].egress is removed"),
    ({"sandboxes": {"egress": {"allowDNS": True, "allow": [{"cidr": "10.0.0.0/8"}]}}},
     "sandboxes.egress is removed"),
    # Local sandboxes would be processes in the controller's pod, their sockets out of the api's reach.
    ({"controller": {"provider": "local"}}, "controller.provider=local is not offered by the chart"),
    # The values of the retired topology: refused with the way to migrate, never silently ignored.
    ({"internalCredential": {"value": "c" * 40}}, "internalCredential is removed"),
    ({"proxy": {"replicas": 3}}, "proxy.* is renamed api.*"),
    ({"scheduler": {"provider": "kubernetes"}}, "scheduler.* is renamed controller.*"),
])
def test_inconsistent_values_fail_with_a_named_reason(helm: Helm, tmp_path: Path, values: dict[str, Any],
                                                      message: str) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    with pytest.raises(HelmError) as err:
        helm.template_text(str(path))
    assert message in str(err.value)


def test_long_release_name_needs_an_installation_name(helm: Helm) -> None:
    proc = helm.run("template", "a-release-name-longer-than-twenty", str(CHART), check=False)
    assert proc.returncode != 0 and "set sandboxes.installation" in proc.stderr
    ok = helm.run("template", "a-release-name-longer-than-twenty", str(CHART), "--set",
                  "sandboxes.installation=prod")
    controller = find(parse(ok.stdout), "Deployment", "-controller")
    assert "--kube-installation=prod" in controller["spec"]["template"]["spec"]["containers"][0]["args"]


# --- NOTES.txt ------------------------------------------------------------------------------


def _notes(helm: Helm, tmp_path: Path, *sets: str) -> str:
    """NOTES.txt rendered through a copy of the chart (helm template does not print notes)."""
    chart = tmp_path / "sandpool"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "files" / "NOTES.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\ndata:\n  notes: |\n'
        '{{- tpl (.Files.Get "files/NOTES.txt") . | nindent 4 }}\n')
    text = helm.template_text(chart=chart, sets=sets, extra=("--show-only", "templates/zz-notes.yaml"))
    return yaml.safe_load(text)["data"]["notes"]


def test_notes_tell_how_to_mint_a_token_and_call_the_api(helm: Helm, tmp_path: Path) -> None:
    notes = _notes(helm, tmp_path)
    assert "kubectl -n sandpool get secret sp-sandpool-signing" in notes
    assert "sandpool token --workspace" in notes
    assert "port-forward svc/sp-sandpool-api" in notes
    assert "rollout status deploy/sp-sandpool-controller deploy/sp-sandpool-api" in notes
    assert "provider: kubernetes" in notes
    assert '"code":"print(1)"' in notes and "/sessions/$SID/exec" in notes
    assert "helm test sp -n sandpool" in notes


def test_notes_with_own_keys_and_ingress(helm: Helm, tmp_path: Path) -> None:
    notes = _notes(helm, tmp_path, "auth.existingSecret=keys", "auth.existingSecretKeyNames={ops}",
                   "ingress.enabled=true", "ingress.tls.enabled=true", "ingress.host=sp.example.org")
    assert "get secret sp-sandpool-signing" not in notes
    assert "YOUR-PRIVATE-KEY.pem" in notes
    assert "https://sp.example.org" in notes
    assert "helm test is off" in notes


def test_docs_describe_every_value() -> None:
    """docs/helm.md's values reference has a row for every leaf of the schema."""
    doc = (CHART.parents[1] / "docs" / "helm.md").read_text()
    schema = json.loads((CHART / "values.schema.json").read_text())
    documented = set(re.findall(r"^\| `([A-Za-z0-9_.\[\]]+)` \|", doc, flags=re.MULTILINE))

    def leaves(node: dict[str, Any], path: str) -> list[str]:
        props = node.get("properties")
        if node.get("type") == "object" and props and node.get("additionalProperties") is False:
            return [leaf for key, child in props.items() for leaf in leaves(child, f"{path}.{key}" if path else key)]
        items = node.get("items")
        if node.get("type") == "array" and isinstance(items, dict) and items.get("properties") and path == "pools":
            return [path, *leaves(items, f"{path}[]")]
        return [path]

    missing = [leaf for leaf in leaves(schema, "") if leaf != "global" and leaf not in documented]
    assert not missing, f"docs/helm.md does not describe: {missing}"
    for heading in ("## Install on kind", "## Install on a managed cluster", "## Values reference",
                    "## Key rotation", "## Upgrades", "## Backup of Redis"):
        assert heading in doc
