"""What only the stand-in API server does on demand: 429 with Retry-After, injected 5xx, lost answers.

Everything else the provider does is tested against a real API server
(`test_k8s_provider.py`); a real one cannot be made to throttle one request or
fail one POST after storing its object when a test asks.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from apiserver import StandInApiServer
from testkit import eventually

from sandpool.controller.provider import PoolSpec, ProviderError

NS = "sandboxes"
POOL = PoolSpec(name="default", image="python", cpu="1", memory="512Mi")


async def test_throttling_and_server_errors_are_retried(make_standin_provider: Any,
                                                        standin: StandInApiServer) -> None:
    provider = await make_standin_provider()
    standin.inject("create", "pods", 429, retry_after=1)
    standin.inject("create", "secrets", 503, times=2)
    started = time.monotonic()
    info = await provider.create(POOL, "sb-t1")
    assert info.ready
    assert time.monotonic() - started >= 1.0  # Retry-After: 1 was honoured, not hammered
    assert standin.status_count(429) == 1 and standin.status_count(503) == 2
    stats = provider.describe()["api"]
    assert stats["throttled"] == 1 and stats["server_errors"] == 2 and stats["retries"] == 3
    standin.inject("delete", "pods", 504)
    await provider.destroy("sb-t1")
    await eventually(lambda: not standin.pods(NS), timeout=10)


async def test_retries_are_bounded(make_standin_provider: Any, standin: StandInApiServer) -> None:
    provider = await make_standin_provider(kube_max_retries=2)
    standin.inject("create", "pods", 503, times=3)
    with pytest.raises(ProviderError) as info:
        await provider.create(POOL, "sb-b1")
    assert info.value.transient
    assert standin.count("create", "pods") == 3  # one try and two retries
    assert standin.pods(NS) == [] and standin.secrets(NS) == []
    standin.inject("delete", "pods", 503, times=3)
    await provider.create(POOL, "sb-b2")
    with pytest.raises(ProviderError):
        await provider.destroy("sb-b2")
    await provider.destroy("sb-b2")  # the controller tries again later: now it goes
    await eventually(lambda: not standin.pods(NS), timeout=10)


async def test_a_retried_create_whose_first_answer_was_lost_adopts_its_own_pod(
        make_standin_provider: Any, standin: StandInApiServer) -> None:
    provider = await make_standin_provider()
    standin.inject("create", "pods", 504, commit=True)  # created, but the answer never came back
    standin.inject("create", "secrets", 504, commit=True)
    info = await provider.create(POOL, "sb-lost")
    assert info.ready
    assert standin.count("create", "pods") == 2 and standin.status_count(409) == 2
    assert len(standin.pods(NS)) == 1 and len(standin.secrets(NS)) == 1
