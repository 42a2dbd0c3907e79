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
