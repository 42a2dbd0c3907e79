"""The provider driven through the real `kubernetes` client against the stand-in API server."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from apiserver import StandInApiServer

from sandpool.pool.provider import PoolSpec, Provider, ProviderError
from sandpool.providers.kubernetes import KubernetesProvider

NS = "sandboxes"
POOL = PoolSpec(name="default", image="python", cpu="1", memory="512Mi")


async def eventually(check: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def test_create_list_destroy(provider: KubernetesProvider, apiserver: StandInApiServer) -> None:
    assert isinstance(provider, Provider)
    info = await provider.create(POOL, "sb-one")
    assert info.ready and info.sandbox_id == "sb-one" and info.pool == "default"
    assert info.address is not None and info.address.startswith("http://127.0.0.")
    assert info.secret and len(info.secret) >= 32
    async with httpx.AsyncClient() as client:
        assert (await client.get(info.address + "/healthz")).status_code == 200
        assert (await client.get(info.address + "/x")).status_code == 401
        ok = await client.get(info.address + "/x", headers={"Authorization": f"Bearer {info.secret}"})
        assert ok.status_code == 200
    (pod,) = apiserver.pods(NS)
    assert info.secret not in str(pod)
    (secret,) = apiserver.secrets(NS)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]

    listed = await provider.list()
    assert [(s.sandbox_id, s.pool, s.address, s.ready) for s in listed] == [("sb-one", "default", info.address, True)]

    await provider.destroy("sb-one")
    assert await provider.list() == []
    await eventually(lambda: not apiserver.pods(NS) and not apiserver.secrets(NS))
    await provider.destroy("sb-one")  # idempotent


@pytest.mark.standin(kubelet="agent")
async def test_real_agent_answers_with_its_secret_once_published(
        provider: KubernetesProvider, apiserver: StandInApiServer) -> None:
    """The stand-in kubelet runs the pod's own command line (`sandpool agent ...`) with the Secret's file."""
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
    await provider.destroy("sb-agent")
    await eventually(lambda: not apiserver.pods(NS))


async def test_restarted_provider_finds_its_sandboxes_by_label(
        make_provider: Any, apiserver: StandInApiServer) -> None:
    first = await make_provider()
    infos = await asyncio.gather(*(first.create(POOL, f"sb-r{i}") for i in range(3)))
    other_pool = PoolSpec(name="big", image="python")
    big = await first.create(other_pool, "sb-big")
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
    await eventually(lambda: [p["metadata"]["name"] for p in apiserver.pods(NS)] == ["other-sb-foreign"])


async def test_watch_resumes_from_its_version_and_relists_after_410(
        provider: KubernetesProvider, apiserver: StandInApiServer) -> None:
    await provider.create(POOL, "sb-w1")
    relists, requests = provider.watcher.relists, provider.watcher.watch_requests
    await eventually(lambda: apiserver.open_watches() == 1)
    apiserver.end_watches()  # the server ends the stream: resume from the last version, no list
    await eventually(lambda: provider.watcher.watch_requests > requests)
    await provider.create(POOL, "sb-w2")
    assert provider.watcher.relists == relists

    await eventually(lambda: apiserver.open_watches() == 1)
    apiserver.compact()  # the stream drops and the history is gone: resuming gets 410 Expired
    await eventually(lambda: provider.watcher.relists > relists)
    info = await provider.create(POOL, "sb-w3")  # readiness still arrives through the new watch
    assert info.ready
    assert set(provider.watcher.pods) == {"test-sb-w1", "test-sb-w2", "test-sb-w3"}


async def test_the_watch_lists_afresh_periodically(make_provider: Any, apiserver: StandInApiServer) -> None:
    provider = await make_provider(kube_relist_seconds=0.01)
    relists = provider.watcher.relists
    await eventually(lambda: apiserver.open_watches() == 1)
    apiserver.end_watches()  # a request ends; the period has passed: list, then watch again
    await eventually(lambda: provider.watcher.relists > relists)
    assert (await provider.create(POOL, "sb-p1")).ready


async def test_pod_deleted_behind_our_back_is_forgotten_and_dead_pod_is_not_ready(
        provider: KubernetesProvider, apiserver: StandInApiServer) -> None:
    await provider.create(POOL, "sb-k1")
    await provider.create(POOL, "sb-k2")
    apiserver.delete_object(NS, "pods", "test-sb-k1")  # kubectl delete pod
    apiserver.kill_container(NS, "test-sb-k2")  # OOM kill: restartPolicy Never, the pod is Failed
    await eventually(lambda: "test-sb-k1" not in provider.watcher.pods
                     and provider.watcher.pods["test-sb-k2"].phase == "Failed")
    assert [(s.sandbox_id, s.ready) for s in await provider.list()] == [("sb-k2", False)]


async def test_throttling_and_server_errors_are_retried(provider: KubernetesProvider,
                                                        apiserver: StandInApiServer) -> None:
    apiserver.inject("create", "pods", 429, retry_after=1)
    apiserver.inject("create", "secrets", 503, times=2)
    started = time.monotonic()
    info = await provider.create(POOL, "sb-t1")
    assert info.ready
    assert time.monotonic() - started >= 1.0  # Retry-After: 1 was honoured, not hammered
    assert apiserver.status_count(429) == 1 and apiserver.status_count(503) == 2
    stats = provider.describe()["api"]
    assert stats["throttled"] == 1 and stats["server_errors"] == 2 and stats["retries"] == 3
    apiserver.inject("delete", "pods", 504)
    await provider.destroy("sb-t1")
    await eventually(lambda: not apiserver.pods(NS))


async def test_retries_are_bounded(make_provider: Any, apiserver: StandInApiServer) -> None:
    provider = await make_provider(kube_max_retries=2)
    apiserver.inject("create", "pods", 503, times=3)
    with pytest.raises(ProviderError) as info:
        await provider.create(POOL, "sb-b1")
    assert info.value.transient
    assert apiserver.count("create", "pods") == 3  # one try and two retries
    assert apiserver.pods(NS) == [] and apiserver.secrets(NS) == []
    apiserver.inject("delete", "pods", 503, times=3)
    await provider.create(POOL, "sb-b2")
    with pytest.raises(ProviderError):
        await provider.destroy("sb-b2")
    await provider.destroy("sb-b2")  # the controller tries again later: now it goes
    await eventually(lambda: not apiserver.pods(NS))


async def test_a_retried_create_whose_first_answer_was_lost_adopts_its_own_pod(
        provider: KubernetesProvider, apiserver: StandInApiServer) -> None:
    apiserver.inject("create", "pods", 504, commit=True)  # created, but the answer never came back
    apiserver.inject("create", "secrets", 504, commit=True)
    info = await provider.create(POOL, "sb-lost")
    assert info.ready
    assert apiserver.count("create", "pods") == 2 and apiserver.status_count(409) == 2
    assert len(apiserver.pods(NS)) == 1 and len(apiserver.secrets(NS)) == 1


async def test_a_pod_that_is_not_ours_is_left_alone(provider: KubernetesProvider,
                                                    apiserver: StandInApiServer) -> None:
    squatter = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "test-sb-taken", "labels": {"x": "y"}},
                "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    apiserver.enforce_restricted = False
    apiserver.kubelet = "none"
    apiserver.create_object(NS, "pods", squatter)
    with pytest.raises(ProviderError, match="already exists") as info:
        await provider.create(POOL, "sb-taken")
    assert not info.value.transient
    assert [p["metadata"]["labels"] for p in apiserver.pods(NS)] == [{"x": "y"}]
    assert apiserver.secrets(NS) == []


async def test_a_leftover_secret_of_an_earlier_pod_is_never_mounted(provider: KubernetesProvider,
                                                                     apiserver: StandInApiServer) -> None:
    """The kubelet mounts whatever Secret carries the name it is given, at once: names are per attempt."""
    first = await provider.create(POOL, "sb-again")
    (old_secret,) = apiserver.secrets(NS)
    await provider.destroy("sb-again")
    await eventually(lambda: not apiserver.pods(NS))
    # The garbage collector lags: the earlier pod's Secret is still there when the id comes back.
    apiserver.create_object(NS, "secrets", {"metadata": {"name": old_secret["metadata"]["name"]},
                                            "data": old_secret["data"]})
    second = await provider.create(POOL, "sb-again")
    assert second.secret != first.secret
    async with httpx.AsyncClient() as client:
        ok = await client.get(second.address + "/x", headers={"Authorization": f"Bearer {second.secret}"})
        assert ok.status_code == 200
        stale = await client.get(second.address + "/x", headers={"Authorization": f"Bearer {first.secret}"})
        assert stale.status_code == 401
    (pod,) = apiserver.pods(NS)
    mounted = pod["spec"]["volumes"][2]["secret"]["secretName"]
    assert mounted != old_secret["metadata"]["name"]
    (owned,) = [s for s in apiserver.secrets(NS) if s["metadata"].get("ownerReferences")]
    assert owned["metadata"]["name"] == mounted and owned["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]


@pytest.mark.standin(kubelet="agent")
async def test_a_container_that_exits_fails_the_create_and_is_deleted(
        provider: KubernetesProvider, apiserver: StandInApiServer) -> None:
    crashing = PoolSpec(name="broken", image="python", command=("sh", "-c", "exit 3"))
    with pytest.raises(ProviderError, match=r"stopped \(Failed, Error\)") as info:
        await provider.create(crashing, "sb-crash")
    assert info.value.transient
    await eventually(lambda: not apiserver.pods(NS) and not apiserver.secrets(NS))


async def test_unknown_runtime_class_is_a_permanent_error(provider: KubernetesProvider,
                                                          apiserver: StandInApiServer) -> None:
    pool = PoolSpec(name="firecracker", image="python", runtime_class="firecracker")
    with pytest.raises(ProviderError, match='RuntimeClass "firecracker" not found') as info:
        await provider.create(pool, "sb-rc")
    assert not info.value.transient
    assert apiserver.count("create", "pods") == 1  # a 403 is not retried
    assert apiserver.count("delete", "pods") == 0  # nor followed by a delete of what was never made
    assert apiserver.pods(NS) == [] and apiserver.secrets(NS) == []
    assert (await provider.create(PoolSpec(name="gvisor", image="python", runtime_class="gvisor"), "sb-rc2")).ready


@pytest.mark.standin(pod_quota=1)
async def test_exhausted_quota_is_transient(provider: KubernetesProvider, apiserver: StandInApiServer) -> None:
    await provider.create(POOL, "sb-q1")
    with pytest.raises(ProviderError, match="exceeded quota") as info:
        await provider.create(POOL, "sb-q2")
    assert info.value.transient
    assert len(apiserver.pods(NS)) == 1


@pytest.mark.standin(kubelet="none")
async def test_a_pod_that_never_gets_ready_is_deleted_after_the_ready_timeout(
        make_provider: Any, apiserver: StandInApiServer) -> None:
    provider = await make_provider(kube_ready_timeout_seconds=0.5)
    with pytest.raises(ProviderError, match="not ready in time") as info:
        await provider.create(POOL, "sb-slow")
    assert info.value.transient
    assert apiserver.pods(NS) == [] and apiserver.secrets(NS) == []


@pytest.mark.standin(kubelet="none")
async def test_a_cancelled_create_deletes_its_pod(provider: KubernetesProvider, apiserver: StandInApiServer) -> None:
    task = asyncio.create_task(provider.create(POOL, "sb-cancel"))
    await eventually(lambda: apiserver.secrets(NS))  # pod and Secret are made; Ready never comes
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: not apiserver.pods(NS) and not apiserver.secrets(NS))


@pytest.mark.parametrize("bad", ["SB-UPPER", "sb_underscore", "", "x" * 64])
async def test_bad_sandbox_id_makes_no_api_call(provider: KubernetesProvider, apiserver: StandInApiServer,
                                                bad: str) -> None:
    before = apiserver.count("create", "pods")
    with pytest.raises(ProviderError, match="is not a DNS label") as info:
        await provider.create(POOL, bad)
    assert not info.value.transient
    assert apiserver.count("create", "pods") == before
    await provider.destroy(bad)  # nothing can exist under such an id: a no-op


async def test_bad_configuration_stops_the_start(make_settings: Any, apiserver: StandInApiServer,
                                                 tmp_path: Any) -> None:
    missing = KubernetesProvider(make_settings(kubeconfig=tmp_path / "nope"))
    with pytest.raises(ProviderError, match="no usable cluster configuration") as info:
        await missing.start()
    assert not info.value.transient and str(tmp_path / "nope") in str(info.value)

    wrong_token = tmp_path / "wrong"
    wrong_token.write_text(apiserver.kubeconfig(tmp_path / "k").read_text().replace(apiserver.token, "wrong"))
    refused = KubernetesProvider(make_settings(kubeconfig=wrong_token))
    with pytest.raises(ProviderError, match="401") as info:
        await refused.start()
    assert not info.value.transient
    with pytest.raises(ProviderError, match="not started"):
        await refused.create(POOL, "sb-1")


async def test_the_stand_in_enforces_what_the_pod_builder_promises(apiserver: StandInApiServer) -> None:
    """The restricted check can fail: a pod without the builder's hardening is refused."""
    import kubernetes.client
    from kubernetes.client.exceptions import ApiException

    configuration = kubernetes.client.Configuration()
    configuration.host = apiserver.url
    configuration.api_key = {"authorization": f"Bearer {apiserver.token}"}
    with kubernetes.client.ApiClient(configuration) as api_client:
        core = kubernetes.client.CoreV1Api(api_client)
        with pytest.raises(ApiException) as info:
            core.create_namespaced_pod(NS, {"metadata": {"name": "lax"},
                                            "spec": {"containers": [{"name": "c", "image": "i"}]}})
    assert info.value.status == 403
    assert "allowPrivilegeEscalation" in info.value.body and "seccompProfile" in info.value.body
