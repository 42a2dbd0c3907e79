"""The security posture of every rendered scenario, asserted on the objects themselves.

What DESIGN.md's security model asks of a cluster install: hardened pods,
a Role (never a ClusterRole) limited to the provider's calls and bound to the
controller alone (the api runs with no token), NetworkPolicies that keep
sandboxes away from everything but the api and the controller, Redis reachable
only from the control plane, and configuration changes that roll the pods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_support import SCENARIOS, Helm, containers, find, parse, pod_spec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

DEFAULT_AND_SCENARIOS = [None, *SCENARIOS]
CONTROLLER = {"app.kubernetes.io/name": "sandpool", "app.kubernetes.io/instance": "sp",
              "app.kubernetes.io/component": "controller"}
API = {**CONTROLLER, "app.kubernetes.io/component": "api"}
EGRESS = {**CONTROLLER, "app.kubernetes.io/component": "egress"}
SANDBOXES = {"app.kubernetes.io/name": "sandpool", "app.kubernetes.io/component": "sandbox",
             "sandpool.dev/installation": "sp"}


def _render(helm: Helm, scenario: str | None) -> list[dict[str, Any]]:
    return helm.render(*(() if scenario is None else (scenario,)))


@pytest.mark.parametrize("scenario", DEFAULT_AND_SCENARIOS, ids=lambda s: s or "defaults")
def test_every_pod_is_hardened(helm: Helm, scenario: str | None) -> None:
    workloads = [o for o in _render(helm, scenario) if pod_spec(o) is not None]
    assert {o["kind"] for o in workloads} >= {"Deployment"}
    for obj in workloads:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        spec = pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec["securityContext"]["runAsUser"] > 0, where
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert spec.get("hostNetwork") is not True and spec.get("hostPID") is not True, where
        assert "hostPath" not in str(spec.get("volumes", [])), where
        # Only the controller talks to the Kubernetes API: the api, Redis, the egress proxy and
        # the test pod get no service account token.
        is_controller = obj["metadata"]["name"].endswith("-controller")
        assert spec["automountServiceAccountToken"] is is_controller, where
        for c in containers(obj):
            cwhere = f"{where} container {c['name']}"
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, cwhere
            assert sc["readOnlyRootFilesystem"] is True, cwhere
            assert sc["privileged"] is False, cwhere
            assert sc["runAsNonRoot"] is True, cwhere
            assert sc["capabilities"] == {"drop": ["ALL"]}, cwhere
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, cwhere
            for kind in ("requests", "limits"):
                assert set(c["resources"][kind]) >= {"cpu", "memory"}, f"{cwhere} {kind}"
            for env in c.get("env", []):
                assert "value" not in env or "redis://" not in env["value"], f"{cwhere}: a Redis URL in plain env"


@pytest.mark.parametrize("scenario", DEFAULT_AND_SCENARIOS, ids=lambda s: s or "defaults")
def test_long_running_containers_have_probes(helm: Helm, scenario: str | None) -> None:
    for obj in _render(helm, scenario):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in pod_spec(obj)["containers"]:
            where = f"{obj['kind']}/{obj['metadata']['name']}"
            assert c.get("livenessProbe") and c.get("readinessProbe"), where
            if c["name"] in ("api", "controller"):
                assert c["livenessProbe"]["httpGet"]["path"] == "/healthz", where
                assert c["readinessProbe"]["httpGet"]["path"] == "/readyz", where


@pytest.mark.parametrize("scenario", DEFAULT_AND_SCENARIOS, ids=lambda s: s or "defaults")
def test_rbac_is_a_namespaced_role_limited_to_the_provider(helm: Helm, scenario: str | None) -> None:
    objs = _render(helm, scenario)
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    role = find(objs, "Role", "-controller")
    sandbox_ns = "sandpool-sandboxes" if scenario in ("gvisor-pools-values.yaml",
                                                       "egress-values.yaml") else "sandpool"
    assert role["metadata"]["namespace"] == sandbox_ns
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): set(r["verbs"]) for r in role["rules"]}
    assert rules == {
        (("",), ("pods",)): {"create", "get", "list", "watch", "delete", "deletecollection"},
        (("",), ("secrets",)): {"create", "get", "delete"},
    }
    binding = find(objs, "RoleBinding", "-controller")
    assert binding["metadata"]["namespace"] == sandbox_ns
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "sp-sandpool-controller",
                                    "namespace": "sandpool"}]
    controller = find(objs, "Deployment", "-controller")
    assert pod_spec(controller)["serviceAccountName"] == "sp-sandpool-controller"
    # The api is bound to nothing: no Role of its own, no account of the controller's.
    api = pod_spec(find(objs, "Deployment", "-api"))
    assert "serviceAccountName" not in api and api["automountServiceAccountToken"] is False
    assert [o["metadata"]["name"] for o in objs if o["kind"] in ("Role", "RoleBinding", "ServiceAccount")] == [
        "sp-sandpool-controller"] * 3


@pytest.mark.parametrize("scenario", DEFAULT_AND_SCENARIOS, ids=lambda s: s or "defaults")
def test_sandboxes_take_ingress_only_from_the_api_and_the_controller_and_have_no_egress(
        helm: Helm, scenario: str | None) -> None:
    objs = _render(helm, scenario)
    policy = find(objs, "NetworkPolicy", "-sandboxes")
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": SANDBOXES}
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    assert spec["egress"] == []
    # The api forwards the session calls; the controller checks a new pod's agent. Both on the agent
    # port only, both from the release namespace only; nothing else may open a connection to a sandbox.
    api, controller = spec["ingress"]
    release = {"kubernetes.io/metadata.name": "sandpool"}
    assert api == {"from": [{"namespaceSelector": {"matchLabels": release}, "podSelector": {"matchLabels": API}}],
                   "ports": [{"port": 8080, "protocol": "TCP"}]}
    assert controller == {"from": [{"namespaceSelector": {"matchLabels": release},
                                    "podSelector": {"matchLabels": CONTROLLER}}],
                          "ports": [{"port": 8080, "protocol": "TCP"}]}
    controller_args = pod_spec(find(objs, "Deployment", "-controller"))["containers"][0]["args"]
    assert "--kube-agent-port=8080" in controller_args
    assert f"--kube-namespace={policy['metadata']['namespace']}" in controller_args


def test_with_the_egress_proxy_sandboxes_may_reach_it_and_nothing_else(helm: Helm) -> None:
    objs = helm.render("egress-values.yaml")
    base = find(objs, "NetworkPolicy", "-sandboxes")["spec"]
    assert base["egress"] == []  # still denied by default: the egress policy below adds one path
    policy = find(objs, "NetworkPolicy", "-sandboxes-egress")
    assert policy["metadata"]["namespace"] == "sandpool-sandboxes"
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": SANDBOXES}
    assert spec["policyTypes"] == ["Egress"] and "ingress" not in spec
    assert spec["egress"] == [{
        "to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "sandpool"}},
                "podSelector": {"matchLabels": EGRESS}}],
        "ports": [{"port": 3128, "protocol": "TCP"}]}]  # no DNS, no other port, no other pod
    service = find(objs, "Service", "-egress")
    assert service["spec"]["selector"] == EGRESS
    # Without the egress proxy: no egress policy, no proxy, and nothing opens a sandbox's egress.
    plain = helm.render()
    assert not [o for o in plain if o["metadata"]["name"].endswith("-egress")]
    assert all(p["spec"].get("egress") in (None, []) for p in plain if p["kind"] == "NetworkPolicy"
               and p["spec"]["podSelector"] == {"matchLabels": SANDBOXES})


def test_the_egress_proxy_takes_only_sandboxes_and_reaches_only_dns_redis_and_public_addresses(helm: Helm) -> None:
    objs = helm.render("egress-values.yaml")
    spec = find(objs, "NetworkPolicy", "-sandpool-egress")["spec"]
    assert spec["podSelector"] == {"matchLabels": EGRESS}
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    sandboxes, metrics = spec["ingress"]
    assert sandboxes == {"from": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "sandpool-sandboxes"}}, "podSelector": {"matchLabels": SANDBOXES}}],
        "ports": [{"port": 3128, "protocol": "TCP"}]}
    assert metrics["ports"] == [{"port": 9464, "protocol": "TCP"}]  # the metrics port: never for sandboxes
    dns, redis, public = spec["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert redis == {"to": [{"podSelector": {"matchLabels": {**EGRESS, "app.kubernetes.io/component": "redis"}}}],
                     "ports": [{"port": 6379, "protocol": "TCP"}]}
    v4, v6 = (peer["ipBlock"] for peer in public["to"])
    assert "ports" not in public and v4["cidr"] == "0.0.0.0/0" and v6["cidr"] == "::/0"
    assert {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10", "127.0.0.0/8",
            "10.96.0.0/12", "10.244.0.0/16"} == set(v4["except"])
    assert {"::1/128", "fc00::/7", "fe80::/10", "fd00:10:96::/112"} == set(v6["except"])
    redis_in = find(objs, "NetworkPolicy", "-redis")["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": EGRESS}} in redis_in
    egress_pod = pod_spec(find(objs, "Deployment", "-egress"))
    assert egress_pod["automountServiceAccountToken"] is False
    [container] = egress_pod["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


@pytest.mark.parametrize("scenario", DEFAULT_AND_SCENARIOS, ids=lambda s: s or "defaults")
def test_controller_only_from_scrapers_and_redis_only_from_control_plane(helm: Helm, scenario: str | None) -> None:
    objs = _render(helm, scenario)
    controller = find(objs, "NetworkPolicy", "-controller")["spec"]
    assert controller["podSelector"] == {"matchLabels": CONTROLLER}
    assert controller["policyTypes"] == ["Ingress"]
    # Nothing calls the controller on the request path, not even the api: only metricsFrom may scrape it.
    if scenario in ("servicemonitor-hpa-values.yaml", "egress-values.yaml"):
        assert controller["ingress"] == [{"from": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}], "ports": [{"port": 8081, "protocol": "TCP"}]}]
    else:
        assert controller["ingress"] == []
    redis = [o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-redis")]
    if scenario == "external-redis-values.yaml":
        assert not redis and not [o for o in objs if o["kind"] == "StatefulSet"]
        return
    [rule] = redis[0]["spec"]["ingress"]
    control_plane = [{"podSelector": {"matchLabels": API}}, {"podSelector": {"matchLabels": CONTROLLER}}]
    if scenario == "egress-values.yaml":  # the egress proxy reads bindings and meters bytes
        control_plane.append({"podSelector": {"matchLabels": EGRESS}})
    assert rule["from"] == control_plane
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]


def test_api_restricted_to_the_ingress_controller_when_asked(helm: Helm) -> None:
    open_policy = find(helm.render(), "NetworkPolicy", "-api")["spec"]
    assert open_policy["ingress"] == [{"ports": [{"port": 8080, "protocol": "TCP"}]}]  # the public entry
    closed = find(helm.render("ingress-tls-values.yaml"), "NetworkPolicy", "-api")["spec"]
    [rule] = closed["ingress"]
    assert rule["from"][0] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "ingress-nginx"}}}
    assert rule["from"][-1]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "test"


def test_every_pod_is_selected_by_a_network_policy(helm: Helm) -> None:
    for scenario in DEFAULT_AND_SCENARIOS:
        objs = _render(helm, scenario)
        selectors = [o["spec"]["podSelector"]["matchLabels"] for o in objs if o["kind"] == "NetworkPolicy"
                     and o["metadata"]["namespace"] == "sandpool"]
        for obj in objs:
            spec = pod_spec(obj)
            if spec is None:
                continue
            metadata = obj["metadata"] if obj["kind"] == "Pod" else obj["spec"]["template"]["metadata"]
            labels = metadata["labels"]
            assert any(sel.items() <= labels.items() for sel in selectors), \
                f"{scenario}: {obj['kind']}/{obj['metadata']['name']} has no NetworkPolicy"


def test_no_network_policies_when_disabled(helm: Helm) -> None:
    objs = helm.render(sets=("networkPolicy.enabled=false",))
    assert not [o for o in objs if o["kind"] == "NetworkPolicy"]


def test_ingress_tls(helm: Helm) -> None:
    ingress = find(helm.render("ingress-tls-values.yaml"), "Ingress", "-api")
    assert ingress["spec"]["tls"] == [{"hosts": ["sandpool.example.com"], "secretName": "sandpool-tls"}]
    assert ingress["spec"]["ingressClassName"] == "nginx"
    [rule] = ingress["spec"]["rules"]
    # Only the API is public: /metrics, /healthz and /readyz stay inside the cluster.
    assert [p["path"] for p in rule["http"]["paths"]] == ["/sessions", "/v1"]
    for path in rule["http"]["paths"]:
        assert path["backend"]["service"] == {"name": "sp-sandpool-api", "port": {"name": "http"}}
    assert not [o for o in helm.render() if o["kind"] == "Ingress"]


def test_pod_disruption_budgets_and_hpa(helm: Helm) -> None:
    objs = helm.render("servicemonitor-hpa-values.yaml")
    for component, labels in (("api", API), ("controller", CONTROLLER)):
        pdb = find(objs, "PodDisruptionBudget", f"-{component}")
        assert pdb["spec"]["selector"] == {"matchLabels": labels} and pdb["spec"]["maxUnavailable"] == 1
    hpa = find(objs, "HorizontalPodAutoscaler", "-api")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sp-sandpool-api"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 20)
    # The HPA owns the replica count: the Deployment must not fight it on every upgrade.
    assert "replicas" not in find(objs, "Deployment", "-api")["spec"]
    assert find(helm.render(), "Deployment", "-api")["spec"]["replicas"] == 2
    assert find(objs, "Deployment", "-controller")["spec"]["replicas"] == 2  # one leader, one standing by
    assert not [o for o in objs if o["kind"] == "HorizontalPodAutoscaler" and "controller" in o["metadata"]["name"]]
    monitor = find(objs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    # It scrapes both: the api's request metrics and the controller's pool gauges, each Service's `http` port.
    [components] = [e["values"] for e in monitor["spec"]["selector"]["matchExpressions"]
                    if e["key"] == "app.kubernetes.io/component"]
    assert components == ["api", "controller"]
    for suffix in ("-api", "-controller"):
        service = find(objs, "Service", suffix)
        assert service["metadata"]["labels"]["app.kubernetes.io/component"] in components
        assert [p["name"] for p in service["spec"]["ports"]] == ["http"]
    egress_monitor = find(helm.render("egress-values.yaml"), "ServiceMonitor")
    assert [e["values"] for e in egress_monitor["spec"]["selector"]["matchExpressions"]][1] == [
        "api", "controller", "egress"]


def _annotations(objs: list[dict[str, Any]], suffix: str) -> dict[str, str]:
    kind = "StatefulSet" if suffix == "-redis" else "Deployment"
    return find(objs, kind, suffix)["spec"]["template"]["metadata"]["annotations"]


def _public_pem() -> str:
    key = Ed25519PrivateKey.generate().public_key()
    return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def test_checksums_roll_exactly_the_pods_whose_configuration_changed(helm: Helm, tmp_path: Path) -> None:
    # Every secret pinned (own public key, no generated signing key, a given Redis password): the
    # checksums depend on the values alone.
    fixed = {"auth": {"publicKeys": {"ops": _public_pem()}, "generateSigningKey": False},
             "redis": {"bundled": {"password": "p" * 24}}, "tests": {"enabled": False}}
    variants = {
        "base": fixed,
        "again": fixed,
        "pools": {**fixed, "pools": [{"name": "default", "warm": 3, "ceiling": 16}]},
        "keys": {**fixed, "auth": {"publicKeys": {"ops": _public_pem()}, "generateSigningKey": False}},
        "redis": {**fixed, "redis": {"bundled": {"password": "p" * 24, "appendfsync": "always"}}},
    }
    ann = {}
    for name, values in variants.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(values))
        objs = parse(helm.template_text(str(path)))
        ann[name] = {s: _annotations(objs, s) for s in ("-api", "-controller", "-redis")}
    assert ann["again"] == ann["base"], "the same values must render the same checksums"
    # The pools: both read pools.yaml.
    for suffix in ("-api", "-controller"):
        assert ann["pools"][suffix]["checksum/pools"] != ann["base"][suffix]["checksum/pools"], suffix
        assert ann["keys"][suffix]["checksum/pools"] == ann["base"][suffix]["checksum/pools"], suffix
    assert ann["pools"]["-redis"] == ann["base"]["-redis"]
    # A trusted key: the api verifies tokens, so its pods roll.
    assert ann["keys"]["-api"]["checksum/secrets"] != ann["base"]["-api"]["checksum/secrets"]
    assert ann["keys"]["-redis"] == ann["base"]["-redis"]
    # Redis's configuration: Redis restarts, with its password unchanged.
    assert ann["redis"]["-redis"]["checksum/config"] != ann["base"]["-redis"]["checksum/config"]
    assert ann["redis"]["-redis"]["checksum/auth"] == ann["base"]["-redis"]["checksum/auth"]


def test_image_pull_secrets_and_digests_reach_every_pod(helm: Helm) -> None:
    digest = "sha256:" + "ab" * 32
    objs = helm.render(sets=("imagePullSecrets={regcred}", f"image.digest={digest}",
                             f"redis.bundled.image.digest={digest}", f"sandboxImage.digest={digest}"))
    workloads = [o for o in objs if pod_spec(o) is not None]
    assert len(workloads) == 4  # api, controller, redis, the helm test pod
    for obj in workloads:
        assert pod_spec(obj)["imagePullSecrets"] == [{"name": "regcred"}], obj["metadata"]["name"]
        for c in containers(obj):
            assert c["image"].endswith("@" + digest), f"{obj['metadata']['name']}: {c['image']}"
    pools = find(objs, "ConfigMap", "-pools")["data"]["pools.yaml"]
    assert f"sandpool/sandbox@{digest}" in pools
