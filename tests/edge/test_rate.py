"""requests_per_minute is exact across api replicas: one atomic counter per workspace and UTC minute."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import redis

from sandpool.state.keys import Keys as RedisKeys

from .conftest import Api, Keys
from .stack import Sandboxes

LIMIT = 25
REQUESTS = 80


async def _burst(urls: list[str], token: str) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(headers=headers, timeout=30) as client:
        calls = [client.post(f"{urls[i % len(urls)]}/sessions/s1/exec",
                             json={"tool": "bash_code_execution", "input": {"command": "true"}})
                 for i in range(REQUESTS)]
        return await asyncio.gather(*calls)


def test_rate_limit_is_exact_under_concurrency_across_two_apis(make_api: Callable[..., Api], keys: Keys,
                                                               sandboxes: Sandboxes, rdb: redis.Redis,
                                                               redis_prefix: str) -> None:
    first, second = make_api(), make_api()
    with first.client(keys.token("ops", admin=True)) as admin:
        assert admin.put("/v1/workspaces/acme/policy", json={"requests_per_minute": LIMIT}).status_code == 200
    started_minute = int(time.time() // 60)
    responses = asyncio.run(_burst([first.url, second.url], keys.token("acme")))
    ended_minute = int(time.time() // 60)

    # Admitted calls reach the session layer (session s1 does not exist: 404); refused ones stop at the edge.
    admitted = [r for r in responses if r.status_code == 404]
    refused = [r for r in responses if r.status_code == 429]
    assert len(admitted) + len(refused) == REQUESTS
    # The burst may straddle a minute boundary: then each minute admits up to LIMIT of its own count.
    k = RedisKeys(redis_prefix)
    counts = [int(rdb.get(k.rate("acme", m)) or 0) for m in range(started_minute, ended_minute + 1)]
    assert sum(counts) == REQUESTS
    assert len(admitted) == sum(min(c, LIMIT) for c in counts)
    assert all(r.json()["reason"] == "not_found" for r in admitted)
    for response in refused:
        body = response.json()
        assert body["reason"] == "quota_exceeded" and body["limit"] == "requests_per_minute"
        assert 1 <= int(response.headers["retry-after"]) <= 60
    assert 0 < rdb.ttl(k.rate("acme", ended_minute)) <= 120  # counters expire

    # Another workspace has its own window; the admin API does not spend the rate.
    sandboxes.publish()
    with first.client(keys.token("globex")) as other:
        assert other.post("/sessions", json={}).status_code == 201
    with first.client(keys.token("acme")) as client:
        assert client.get("/v1/usage").status_code == 200
