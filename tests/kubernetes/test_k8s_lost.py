"""A sandbox whose pod dies behind the provider's back reaches its loss listener at once.

Against the real API server: a warm pod deleted out of band (`kubectl delete pod`),
a pod whose container dies (Failed), and the same after the API server restarts
(the watch resumes, gets `410 Gone`, lists afresh) — each reaches the listener
registered with `on_lost` within about a second. The window from the deletion to
the listener is printed (`-s` shows it); it is a measurement, not an assertion.
The provider's own destroys and failed creates are never reported.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kubelet import StandInKubelet
from realapi import RealCluster
from testkit import eventually

from sandpool.controller.provider import LOSS_REASONS, PoolSpec, ProviderError
from sandpool.providers.kubernetes import KubernetesProvider
from sandpool.providers.kubernetes.pods import PodState
from sandpool.providers.kubernetes.watch import loss_of

POOL = PoolSpec(name="default", image="python")


class Losses:
    """The listener: what it was told, and when (monotonic)."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str]] = []
        self.at: dict[str, float] = {}

    def __call__(self, sandbox_id: str, reason: str) -> None:
        assert reason in LOSS_REASONS
        self.told.append((sandbox_id, reason))
        self.at.setdefault(sandbox_id, time.monotonic())

    async def reported(self, sandbox_id: str, timeout: float = 30.0) -> str:
        """Why the listener was told `sandbox_id` is lost, once it is (up to `timeout`)."""
        await eventually(lambda: sandbox_id in self.at, timeout=timeout, interval=0.005,
                         what=f"{sandbox_id} reported lost", state=lambda: f"told: {self.told}")
        return next(reason for sid, reason in self.told if sid == sandbox_id)


def window(what: str, started: float, losses: Losses, sandbox_id: str) -> None:
    print(f"\nloss window ({what}): {losses.at[sandbox_id] - started:.3f} s from the API call to the listener")


def state(**overrides: Any) -> PodState:
    values: dict[str, Any] = dict(name="p", uid="u1", sandbox_id="sb", pool="default", phase="Running", ready=True,
                                  pod_ip="10.0.0.1", terminating=False, resource_version="1", attempt="a")
    values.update(overrides)
    return PodState(**values)


@pytest.mark.parametrize(("old", "new", "reason"), [
    (state(), None, "deleted"),
    (state(), state(terminating=True), "deleted"),
    (state(), state(phase="Failed"), "failed"),
    (state(), state(phase="Succeeded"), "failed"),
    (state(), state(phase="Unknown"), "not_running"),
    (state(), state(pod_ip=None), "not_running"),
    (state(), state(ready=False), None),  # the Ready condition flaps while the agent is busy: no loss
    (None, state(phase="Pending", pod_ip=None), None),  # still starting: its create waits
    (None, state(phase="Failed"), "failed"),
    (state(phase="Pending", pod_ip=None), state(), None),
    (state(uid="u0"), state(pod_ip=None), None),  # a namesake is a new pod, not a change
])
def test_which_changes_are_losses(old: PodState | None, new: PodState | None, reason: str | None) -> None:
    assert loss_of(old, new) == reason


async def test_a_warm_pod_deleted_or_failed_out_of_band_reaches_the_listener_at_once(
        provider: KubernetesProvider, cluster: RealCluster, namespace: str, kubelet: StandInKubelet) -> None:
    losses = Losses()
    provider.on_lost(losses)
    await asyncio.gather(*(provider.create(POOL, f"sb-l{i}") for i in range(4)))

    started = time.monotonic()
    cluster.delete_pod(namespace, "test-sb-l0")  # kubectl delete pod: graceful, the kubelet finishes it
    assert await losses.reported("sb-l0") == "deleted"
    window("graceful delete", started, losses, "sb-l0")

    started = time.monotonic()
    cluster.delete_pod(namespace, "test-sb-l1", grace_seconds=0)  # --grace-period=0 --force
    assert await losses.reported("sb-l1") == "deleted"
    window("forced delete", started, losses, "sb-l1")

    started = time.monotonic()
    kubelet.kill_container("test-sb-l2")  # OOM kill: restartPolicy Never, the pod turns Failed
    assert await losses.reported("sb-l2") == "failed"
    window("container died", started, losses, "sb-l2")

    # Our own destroy is no loss; nor is a second event about a pod already reported.
    await provider.destroy("sb-l3")
    await asyncio.sleep(0.5)
    assert sorted(losses.told) == [("sb-l0", "deleted"), ("sb-l1", "deleted"), ("sb-l2", "failed")]
    assert provider.describe()["sandboxes"]["lost"] == 3


@pytest.mark.kubelet("agent")
async def test_a_failed_create_is_not_a_loss(provider: KubernetesProvider) -> None:
    losses = Losses()
    provider.on_lost(losses)
    with pytest.raises(ProviderError, match="stopped"):
        await provider.create(PoolSpec(name="broken", image="python", command=("sh", "-c", "exit 3")), "sb-crash")
    await asyncio.sleep(0.5)
    assert losses.told == []


async def test_losses_reach_the_listener_after_an_api_server_restart_and_a_410(
        make_provider: Any, cluster: RealCluster, namespace: str) -> None:
    """The watch outlives the API server: it resumes from its version, the restarted server answers
    `410 Gone` (its watch cache starts after that version), the provider lists afresh, and a pod
    deleted then, or while it was not watching, is reported at once."""
    provider: KubernetesProvider = await make_provider()
    losses = Losses()
    provider.on_lost(losses)
    await asyncio.gather(*(provider.create(POOL, f"sb-a{i}") for i in range(3)))
    expired, relists = provider.watcher.expired, provider.watcher.relists

    await asyncio.to_thread(cluster.restart_apiserver)
    # Deleted before the watch is back (it may still be waiting out its backoff): the list finds it.
    started = time.monotonic()
    cluster.delete_pod(namespace, "test-sb-a0", grace_seconds=0)
    assert await losses.reported("sb-a0") == "deleted"
    window("deleted just after an API-server restart", started, losses, "sb-a0")
    await eventually(lambda: provider.watcher.expired > expired and provider.watcher.relists > relists, timeout=30,
                     what="the expired watch relisted")

    started = time.monotonic()
    cluster.delete_pod(namespace, "test-sb-a1")
    assert await losses.reported("sb-a1") == "deleted"
    window("deleted once the watch resumed after 410", started, losses, "sb-a1")
    assert [sid for sid, _ in losses.told] == ["sb-a0", "sb-a1"]
    assert (await provider.create(POOL, "sb-a3")).ready  # and creates see readiness through the new watch
