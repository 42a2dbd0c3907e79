"""What the real API server admits: Pod Security `restricted`, the chart's RBAC, the rendered chart.

- Every pod the builder makes for the shipped pool examples passes `restricted`
  admission with strict field validation (an unknown field is an error, not
  silently dropped); a pod without the hardening is refused, so the check can fail.
- The controller's provider does its whole job with exactly the chart's Role (rendered
  by helm), as the chart's ServiceAccount (a token from the TokenRequest API), and
  nothing more; the api's pods get no token at all.
- The rendered chart passes a server-side dry run (`kubectl apply --server-side
  --dry-run=server`): every object is one this API server version accepts.
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubelet import StandInKubelet
from realapi import RealCluster
from testkit import tool

from sandpool.controller.provider import PoolSpec, ProviderError
from sandpool.controller.templates import load_pools
from sandpool.providers.kubernetes import KubernetesProvider
from sandpool.providers.kubernetes.pods import PodOptions, build_pod, build_secret

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "sandpool"
RELEASE = "sp"
STRICT = {"dryRun": "All", "fieldValidation": "Strict"}


@pytest.fixture(scope="module")
def helm() -> str:
    return tool("helm")


def render(helm: str, release_namespace: str, sandbox_namespace: str) -> str:
    return subprocess.run(
        [helm, "template", RELEASE, str(CHART), "--namespace", release_namespace,
         "--set", f"sandboxes.namespace={sandbox_namespace}", "--set", "sandboxes.createNamespace=true",
         "--set", "controller.provider=kubernetes"],
        capture_output=True, text=True, timeout=60, check=True).stdout


def test_every_shipped_pool_pod_passes_restricted_admission(cluster: RealCluster, namespace: str) -> None:
    opts = PodOptions(namespace=namespace)
    pools = [pool for path in sorted((ROOT / "deploy" / "pools").glob("*.yaml")) for pool in load_pools(path)]
    for runtime_class in {p.runtime_class for p in pools if p.runtime_class}:
        cluster.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", ok=(201, 409),
                        body={"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                              "metadata": {"name": runtime_class}, "handler": runtime_class})
    assert len(pools) >= 3
    for i, pool in enumerate(pools):
        pod = build_pod(pool, f"sb-{i}", opts, attempt="a1")
        stored = cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=pod, params=STRICT)
        assert stored["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        secret = build_secret(pool, f"sb-{i}", opts, secret="s" * 43, owner_uid=str(uuid.uuid4()), attempt="a1")
        cluster.request("POST", f"/api/v1/namespaces/{namespace}/secrets", body=secret, params=STRICT)

    lax = {"metadata": {"name": "lax"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    refused = cluster.client.post(f"/api/v1/namespaces/{namespace}/pods", json=lax, params=STRICT)
    assert refused.status_code == 403
    assert "restricted" in refused.text and "allowPrivilegeEscalation" in refused.text
    assert "seccompProfile" in refused.text and "runAsNonRoot" in refused.text

    typo = build_pod(pools[0], "sb-typo", opts, attempt="a1")
    typo["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesytem"] = True  # misspelt
    refused = cluster.client.post(f"/api/v1/namespaces/{namespace}/pods", json=typo, params=STRICT)
    assert refused.status_code == 400 and "readOnlyRootFilesytem" in refused.text


async def test_the_rendered_chart_passes_a_server_side_dry_run_and_its_role_is_enough(
        helm: str, cluster: RealCluster, namespace: str, kubelet: StandInKubelet, tmp_path: Path,
        make_settings: Any) -> None:
    release_namespace = cluster.namespace(f"r-{uuid.uuid4().hex[:10]}")
    text = render(helm, release_namespace, namespace)
    (tmp_path / "chart.yaml").write_text(text)
    kubectl = tool("kubectl")
    admin = cluster.kubeconfig(tmp_path / "admin-kubeconfig")
    # kubectl against the real API server (a process of its own); nothing on this loop has work meanwhile
    applied = subprocess.run(  # noqa: ASYNC221 - see above
        [str(kubectl), "--kubeconfig", str(admin), "apply", "--server-side", "--dry-run=server",
         "--field-manager=helm", "--validate=strict", "-f", str(tmp_path / "chart.yaml")],
        capture_output=True, text=True, timeout=120)
    assert applied.returncode == 0, applied.stderr
    objects = [doc for doc in yaml.safe_load_all(text) if doc]
    assert len(applied.stdout.strip().splitlines()) == len(objects)  # one line per object: every one checked

    # Now for real: the chart's ServiceAccount, Role and RoleBinding, and nothing else.
    def one(kind: str) -> dict[str, Any]:
        (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].startswith(RELEASE)]
        return found

    account, role, binding = one("ServiceAccount"), one("Role"), one("RoleBinding")
    # The one account is the controller's; the api runs as no account of the chart's, without a token.
    (controller,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-controller")]
    (api,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-api")]
    assert controller["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": release_namespace}]
    assert "serviceAccountName" not in api["spec"]["template"]["spec"]
    assert api["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert role["metadata"]["namespace"] == namespace and binding["metadata"]["namespace"] == namespace
    cluster.request("POST", f"/api/v1/namespaces/{release_namespace}/serviceaccounts", body=account)
    cluster.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles", body=role)
    cluster.request("POST", f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", body=binding)
    token = cluster.service_account_token(release_namespace, account["metadata"]["name"])
    kubeconfig = cluster.kubeconfig(tmp_path / "controller-kubeconfig", token=token)
    assert not any(o["kind"] in ("ClusterRole", "ClusterRoleBinding") for o in objects)

    provider = KubernetesProvider(make_settings(kubeconfig=kubeconfig))
    await provider.start()  # lists and watches pods
    try:
        pool = PoolSpec(name="default", image="python")
        infos = [await provider.create(pool, f"sb-rbac{i}") for i in range(3)]
        assert all(info.ready for info in infos)
        assert {s.sandbox_id for s in await provider.list()} == {"sb-rbac0", "sb-rbac1", "sb-rbac2"}
        await provider.destroy("sb-rbac0")  # by name
        await asyncio.gather(provider.destroy("sb-rbac1"), provider.destroy("sb-rbac2"))  # deletecollection
        assert await provider.list() == []
        assert provider.describe()["api"]["by_operation"].get("delete_pods", 0) >= 1
    finally:
        await provider.close()
    # ... and the same credential anywhere else is refused: the Role is the whole grant.
    elsewhere = KubernetesProvider(make_settings(kubeconfig=kubeconfig, kube_namespace=release_namespace))
    with pytest.raises(ProviderError, match="403") as info:
        await elsewhere.start()
    assert not info.value.transient
    forbidden = cluster.client.get(f"/api/v1/namespaces/{namespace}/secrets",
                                   headers={"Authorization": f"Bearer {token}"})
    assert forbidden.status_code == 403  # secrets are created and read by name, never listed
