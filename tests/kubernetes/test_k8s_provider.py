"""The provider through the real `kubernetes` client against a real API server (and the stand-in kubelet).

Each test has a namespace of its own enforcing Pod Security `restricted`. There is
no garbage collector here (no controller-manager): a pod's Secret outlives it, so
the tests check the Secret's ownerReference instead of waiting for it to go.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from kubelet import StandInKubelet
from realapi import RealCluster
from testkit import eventually

from sandpool.controller.provider import PoolSpec, Provider, ProviderError
from sandpool.providers.kubernetes import KubernetesProvider
from sandpool.providers.kubernetes.pods import PodOptions, build_pod

POOL = PoolSpec(name="default", image="python", cpu="1", memory="512Mi")


def names(pods: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["name"] for p in pods}


async def test_create_list_destroy(provider: KubernetesProvider, cluster: RealCluster, namespace: str) -> None:
    assert isinstance(provider, Provider)
    info = await provider.create(POOL, "sb-one")
    assert info.ready and info.sandbox_id == "sb-one" and info.pool == "default"
    assert info.address is not None and info.address.startswith("http://127.0.")
    assert info.secret and len(info.secret) >= 32
    async with httpx.AsyncClient() as client:
        assert (await client.get(info.address + "/healthz")).status_code == 200
        assert (await client.get(info.address + "/x")).status_code == 401
        ok = await client.get(info.address + "/x", headers={"Authorization": f"Bearer {info.secret}"})
        assert ok.status_code == 200
    (pod,) = cluster.pods(namespace)
    assert info.secret not in str(pod)
    assert pod["spec"]["nodeName"] == "stand-in-node" and pod["status"]["podIP"] in info.address
    (secret,) = cluster.secrets(namespace, "sandpool.dev/sandbox=sb-one")
    # The garbage collector deletes it with the pod (on a real cluster): owned by exactly this pod.
    assert secret["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Pod", "name": "test-sb-one",
                                                      "uid": pod["metadata"]["uid"]}]

    listed = await provider.list()
    assert [(s.sandbox_id, s.pool, s.address, s.ready) for s in listed] == [("sb-one", "default", info.address, True)]

    await provider.destroy("sb-one")
    assert await provider.list() == []  # being deleted: no longer listed
    await eventually(lambda: not cluster.pods(namespace), timeout=10)  # the kubelet stopped it and finished the delete
    await provider.destroy("sb-one")  # idempotent


async def test_pods_are_stored_as_hardened_as_built(provider: KubernetesProvider, cluster: RealCluster,
                                                    namespace: str) -> None:
    """What the API server stores (after defaulting and admission) keeps every hardening field."""
    await provider.create(POOL, "sb-hard")
    (stored,) = cluster.pods(namespace)
    attempt = stored["metadata"]["annotations"]["sandpool.dev/create-attempt"]
    built = build_pod(POOL, "sb-hard", provider.options, attempt=attempt)

    def subset(want: Any, have: Any, where: str) -> None:
        if isinstance(want, dict):
            for key, value in want.items():
                assert key in have, f"{where}.{key} was dropped by the API server"
                subset(value, have[key], f"{where}.{key}")
        elif isinstance(want, list) and want and isinstance(want[0], dict):
            assert len(want) == len(have), where
            for i, (w, h) in enumerate(zip(want, have, strict=True)):
                subset(w, h, f"{where}[{i}]")
        else:
            assert want == have, f"{where}: built {want!r}, stored {have!r}"

    spec = built["spec"]
    subset(spec["securityContext"], stored["spec"]["securityContext"], "spec.securityContext")
    for key in ("automountServiceAccountToken", "enableServiceLinks", "restartPolicy", "volumes"):
        subset(spec[key], stored["spec"][key], f"spec.{key}")
    subset(spec["containers"][0], stored["spec"]["containers"][0], "spec.containers[0]")
    assert stored["metadata"]["labels"] == built["metadata"]["labels"]


@pytest.mark.kubelet("agent")
async def test_real_agent_answers_with_its_secret_once_published(provider: KubernetesProvider) -> None:
    """The kubelet runs the pod's own command line (`sandpool agent ...`) with the Secret's file."""
    info = await provider.create(POOL, "sb-agent")
    async with httpx.AsyncClient(base_url=info.address, timeout=30) as client:
        # Published means answering: the very first call after create() runs code.
        ran = await client.post("/sessions/s1/exec", json={"tool": "code_execution", "input": {"code": "print(6*7)"}},
                                headers={"Authorization": f"Bearer {info.secret}"})
        assert ran.status_code == 200, ran.text
        assert "42" in ran.text
        refused = await client.post("/sessions/s1/exec", json={"tool": "code_execution", "input": {"code": "1"}},
                                    headers={"Authorization": "Bearer not-the-secret"})
        assert refused.status_code == 401


async def test_restarted_provider_finds_its_sandboxes_by_label(
        make_provider: Any, cluster: RealCluster, namespace: str) -> None:
    first = await make_provider()
    infos = await asyncio.gather(*(first.create(POOL, f"sb-r{i}") for i in range(3)))
    big = await first.create(PoolSpec(name="big", image="python"), "sb-big")
    # Another installation's pod in the same namespace is none of ours.
    await (await make_provider(kube_installation="other")).create(POOL, "sb-foreign")
    await first.close()  # a crash or restart: close() destroys nothing

    second = await make_provider()
    listed = sorted((s.sandbox_id, s.pool, s.address, s.ready) for s in await second.list())
    assert listed == sorted([(i.sandbox_id, "default", i.address, True) for i in infos]
                            + [("sb-big", "big", big.address, True)])
    assert all(s.secret is None for s in await second.list())  # secrets stay in Redis, never re-read
    assert len(second.watcher.pods) == 4  # the restarted watch starts from a full list
    for sandbox in ("sb-r0", "sb-r1", "sb-r2", "sb-big"):
        await second.destroy(sandbox)
    assert await second.list() == []
    await eventually(lambda: names(cluster.pods(namespace)) == {"other-sb-foreign"}, timeout=10)


async def test_the_watch_resumes_when_the_server_ends_it_and_lists_afresh_periodically(
        make_provider: Any) -> None:
    """The real server ends each watch request after `timeoutSeconds`; the watch resumes from its
    version (no list), or lists afresh once `--kube-relist-seconds` have passed."""
    resuming = await make_provider(kube_watch_timeout_seconds=5)
    relisting = await make_provider(kube_watch_timeout_seconds=5, kube_relist_seconds=0.01)
    await resuming.create(POOL, "sb-w1")
    lists = (resuming.watcher.relists, relisting.watcher.relists)
    await eventually(lambda: resuming.watcher.watch_requests >= 2 and relisting.watcher.watch_requests >= 2,
                     timeout=15)
    assert resuming.watcher.relists == lists[0]
    assert relisting.watcher.relists > lists[1]
    assert (await resuming.create(POOL, "sb-w2")).ready  # readiness still arrives through the resumed watch
    assert {"test-sb-w1", "test-sb-w2"} <= set(relisting.watcher.pods)


async def test_pod_deleted_behind_our_back_is_forgotten_and_dead_pod_is_not_ready(
        provider: KubernetesProvider, cluster: RealCluster, namespace: str, kubelet: StandInKubelet) -> None:
    await provider.create(POOL, "sb-k1")
    await provider.create(POOL, "sb-k2")
    cluster.delete_pod(namespace, "test-sb-k1")  # kubectl delete pod
    kubelet.kill_container("test-sb-k2")  # OOM kill: restartPolicy Never, the pod is Failed
    await eventually(lambda: "test-sb-k1" not in provider.watcher.pods
                     and provider.watcher.pods["test-sb-k2"].phase == "Failed", timeout=10)
    assert [(s.sandbox_id, s.ready) for s in await provider.list()] == [("sb-k2", False)]


async def test_a_pod_that_is_not_ours_is_left_alone(provider: KubernetesProvider, cluster: RealCluster,
                                                    namespace: str) -> None:
    squatter = build_pod(POOL, "sb-taken", PodOptions(namespace=namespace, installation="test"), attempt="theirs")
    squatter["metadata"]["labels"] = {"x": "y"}
    squatter["metadata"]["annotations"] = {}
    cluster.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=squatter)
    with pytest.raises(ProviderError, match="already exists") as info:
        await provider.create(POOL, "sb-taken")
    assert not info.value.transient
    assert [p["metadata"]["labels"] for p in cluster.pods(namespace)] == [{"x": "y"}]
    assert cluster.secrets(namespace, "sandpool.dev/sandbox") == []


async def test_a_leftover_secret_of_an_earlier_pod_is_never_mounted(
        provider: KubernetesProvider, cluster: RealCluster, namespace: str) -> None:
    """The kubelet mounts whatever Secret carries the name it is given, at once: names are per attempt.

    Without a garbage collector the earlier pod's Secret stays, as it does on a cluster whose
    collector lags."""
    first = await provider.create(POOL, "sb-again")
    (old_secret,) = cluster.secrets(namespace, "sandpool.dev/sandbox=sb-again")
    await provider.destroy("sb-again")
    await eventually(lambda: not cluster.pods(namespace), timeout=10)
    second = await provider.create(POOL, "sb-again")
    assert second.secret != first.secret
    async with httpx.AsyncClient() as client:
        ok = await client.get(second.address + "/x", headers={"Authorization": f"Bearer {second.secret}"})
        assert ok.status_code == 200
        stale = await client.get(second.address + "/x", headers={"Authorization": f"Bearer {first.secret}"})
        assert stale.status_code == 401
    (pod,) = cluster.pods(namespace)
    mounted = next(v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v)
    assert mounted != old_secret["metadata"]["name"]
    owned = [s for s in cluster.secrets(namespace, "sandpool.dev/sandbox=sb-again")
             if s["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]]
    assert [s["metadata"]["name"] for s in owned] == [mounted]


@pytest.mark.kubelet("agent")
async def test_a_container_that_exits_fails_the_create_and_is_deleted(
        provider: KubernetesProvider, cluster: RealCluster, namespace: str) -> None:
    crashing = PoolSpec(name="broken", image="python", command=("sh", "-c", "exit 3"))
    with pytest.raises(ProviderError, match=r"stopped \(Failed, Error\)") as info:
        await provider.create(crashing, "sb-crash")
    assert info.value.transient
    await eventually(lambda: not cluster.pods(namespace), timeout=10)


async def test_unknown_runtime_class_is_a_permanent_error(provider: KubernetesProvider, cluster: RealCluster,
                                                          namespace: str) -> None:
    cluster.request("POST", "/apis/node.k8s.io/v1/runtimeclasses", ok=(201, 409),
                    body={"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "gvisor"},
                          "handler": "runsc"})
    calls = provider.api.stats.by_operation.copy()
    pool = PoolSpec(name="firecracker", image="python", runtime_class="firecracker")
    with pytest.raises(ProviderError, match='RuntimeClass "firecracker" not found') as info:
        await provider.create(pool, "sb-rc")
    assert not info.value.transient
    after = provider.api.stats.by_operation
    assert after.get("create_pod", 0) - calls.get("create_pod", 0) == 1  # a 403 is not retried
    assert after.get("delete_pod", 0) == calls.get("delete_pod", 0)  # nor followed by a delete
    assert cluster.pods(namespace) == []
    stored = await provider.create(PoolSpec(name="gvisor", image="python", runtime_class="gvisor"), "sb-rc2")
    assert stored.ready
    (pod,) = cluster.pods(namespace)
    assert pod["spec"]["runtimeClassName"] == "gvisor"


async def test_exhausted_quota_is_transient(provider: KubernetesProvider, cluster: RealCluster,
                                            namespace: str) -> None:
    quota = f"/api/v1/namespaces/{namespace}/resourcequotas"
    cluster.request("POST", quota, body={"metadata": {"name": "pods"}, "spec": {"hard": {"pods": "1"}}})
    # The resource-quota controller (not running here) publishes the quota's status; play it.
    cluster.request("PATCH", f"{quota}/pods/status", body={"status": {"hard": {"pods": "1"}, "used": {"pods": "0"}}},
                    **{"Content-Type": "application/merge-patch+json"})
    await provider.create(POOL, "sb-q1")
    with pytest.raises(ProviderError, match="exceeded quota") as info:
        await provider.create(POOL, "sb-q2")
    assert info.value.transient
    assert names(cluster.pods(namespace)) == {"test-sb-q1"}


@pytest.mark.kubelet("none")
async def test_a_pod_that_never_gets_ready_is_deleted_after_the_ready_timeout(
        make_provider: Any, cluster: RealCluster, namespace: str) -> None:
    provider = await make_provider(kube_ready_timeout_seconds=0.5)
    with pytest.raises(ProviderError, match="not ready in time") as info:
        await provider.create(POOL, "sb-slow")
    assert info.value.transient
    assert cluster.pods(namespace) == []  # an unscheduled pod goes at once


@pytest.mark.kubelet("none")
async def test_a_cancelled_create_deletes_its_pod(provider: KubernetesProvider, cluster: RealCluster,
                                                  namespace: str) -> None:
    task = asyncio.create_task(provider.create(POOL, "sb-cancel"))
    # Ready never comes:
    await eventually(lambda: cluster.secrets(namespace, "sandpool.dev/sandbox=sb-cancel"), timeout=10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: not cluster.pods(namespace), timeout=10)


@pytest.mark.parametrize("bad", ["SB-UPPER", "sb_underscore", "", "x" * 64])
async def test_bad_sandbox_id_makes_no_api_call(provider: KubernetesProvider, bad: str) -> None:
    before = provider.api.stats.calls
    with pytest.raises(ProviderError, match="is not a DNS label") as info:
        await provider.create(POOL, bad)
    assert not info.value.transient
    await provider.destroy(bad)  # nothing can exist under such an id: a no-op
    assert provider.api.stats.calls == before


async def test_bad_configuration_stops_the_start(make_settings: Any, cluster: RealCluster, tmp_path: Any) -> None:
    missing = KubernetesProvider(make_settings(kubeconfig=tmp_path / "nope"))
    with pytest.raises(ProviderError, match="no usable cluster configuration") as info:
        await missing.start()
    assert not info.value.transient and str(tmp_path / "nope") in str(info.value)

    refused = KubernetesProvider(make_settings(kubeconfig=cluster.kubeconfig(tmp_path / "k", token="not-a-token")))
    with pytest.raises(ProviderError, match="401") as info:
        await refused.start()
    assert not info.value.transient
    with pytest.raises(ProviderError, match="not started"):
        await refused.create(POOL, "sb-1")
