"""The Redis client every service uses, built in one place (timeouts, pool size, decoding)."""

from __future__ import annotations

from typing import Any

import redis as redis_sync
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from sandpool.core.redact import redact
from sandpool.state.errors import UNREACHABLE, StateUnavailable, translated

Client = aioredis.Redis


def connect(url: str, *, timeout: float, max_connections: int = 256) -> aioredis.Redis:
    """An asyncio client: every command bounded by `timeout`, connections pooled and health-checked.

    A command whose connection fails is sent again, up to twice, on a fresh connection: after a
    Redis restart every pooled connection is dead, and without this each one costs a caller a 503
    (redis-py retries nothing unless told). Timeouts are not retried, so a stalled Redis still fails
    within `timeout`. A script whose answer was lost with its connection may run twice: the lease
    and a waiter's claim answer the repeat with what their first run did (a session id is theirs
    alone); the others are no worse than a caller retrying on the 503."""
    return aioredis.Redis.from_url(
        url, decode_responses=True, socket_timeout=timeout, socket_connect_timeout=timeout,
        max_connections=max_connections, health_check_interval=30,
        retry=Retry(ExponentialWithJitterBackoff(base=0.02, cap=0.25), retries=2,
                    supported_errors=(RedisConnectionError,)),
    )


@translated
async def ping(client: aioredis.Redis) -> bool:
    return bool(await client.ping())


async def close(client: aioredis.Redis) -> None:
    await client.aclose()


def ping_sync(url: str, *, timeout: float = 2.0) -> None:
    """For command-line tools before their event loop runs: raise `StateUnavailable` naming the
    (redacted) URL when Redis does not answer."""
    client: Any = redis_sync.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        client.ping()
    except (*UNREACHABLE, redis_sync.RedisError, OSError) as exc:
        raise StateUnavailable(f"Redis at {redact(url)} does not answer ({exc})") from None
    finally:
        client.close()


def ready_count_sync(url: str, ready_key: str, *, timeout: float = 2.0) -> int:
    """How many sandboxes a pool has ready, for command-line tools (`StateUnavailable` if Redis is away)."""
    client: Any = redis_sync.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return int(client.llen(ready_key))
    except (*UNREACHABLE, redis_sync.RedisError, OSError) as exc:
        raise StateUnavailable(str(exc)) from None
    finally:
        client.close()
