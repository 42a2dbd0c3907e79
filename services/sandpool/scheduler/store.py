"""The scheduler's Redis adapter: the only scheduler module that imports `redis`.

Each public method is one round trip running one of the scripts in
`scheduler/scripts.py` (loaded once with SCRIPT LOAD, then called by SHA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sandpool.scheduler import scripts
from sandpool.scheduler.limits import SessionLimits, utc_day
from sandpool.state.keys import USAGE_DAY_RETENTION_DAYS, USAGE_STREAM_MAXLEN, Keys

REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError)
"""Errors that mean Redis could not be reached or did not answer in time (a 503, never a 500)."""
REDIS_UNAVAILABLE = (*REDIS_ERRORS, OSError)

KEY_EXPIRY_MARGIN_SECONDS = 3600
"""Session keys expire this long after their max lifetime: a safety net behind the reaper."""

_RETENTION_SECONDS = USAGE_DAY_RETENTION_DAYS * 86400
_HOLE = "\x00"


def _split(template: str) -> tuple[str, str]:
    head, _, tail = template.partition(_HOLE)
    return head, tail


def connect(url: str, *, timeout: float, max_connections: int) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url, decode_responses=True, socket_timeout=timeout, socket_connect_timeout=timeout,
        max_connections=max_connections, health_check_interval=30,
    )


@dataclass(frozen=True)
class Leased:
    sandbox: str
    address: str
    secret: str


@dataclass(frozen=True)
class Refused:
    kind: str  # "capacity" | "quota"
    limit: str  # "capacity" | "concurrent_sessions" | "daily_session_seconds"


@dataclass(frozen=True)
class Target:
    """Where a session's calls go, and the exec timeouts in force for it."""

    address: str
    secret: str
    exec_timeout_seconds: int
    max_exec_timeout_seconds: int


@dataclass(frozen=True)
class Released:
    reason: str  # destroy | dead | idle | lifetime
    session_seconds: float
    address: str
    sandbox: str


@dataclass(frozen=True)
class PoolCounts:
    starting: int
    ready: int
    leased: int
    doomed: int


class SessionStore:
    """Sessions, leases and usage in Redis, one script per state change."""

    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._lease = client.register_script(scripts.LEASE)
        self._touch = client.register_script(scripts.TOUCH)
        self._done = client.register_script(scripts.DONE)
        self._release = client.register_script(scripts.RELEASE)
        self._pool_stats = client.register_script(scripts.POOL_STATS)
        self._ws_sessions = _split(keys.workspace_sessions(_HOLE))
        self._usage_total = _split(keys.usage_total(_HOLE))

    async def load_scripts(self) -> None:
        """Load every script up front so the first request pays no SCRIPT LOAD."""
        for script in (self._lease, self._touch, self._done, self._release, self._pool_stats):
            await self.redis.script_load(script.script)

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def lease(self, *, session_id: str, workspace: str, pool: str, image: str, now: float,
                    limits: SessionLimits, max_concurrent: int, daily_budget: int,
                    meter_capacity_refusal: bool = True) -> Leased | Refused:
        k = self.keys
        day = utc_day(now)
        result = await self._lease(
            keys=[k.pool_ready(pool), k.session(session_id), k.deadlines, k.workspace_sessions(workspace),
                  k.usage_total(workspace), k.usage_day(workspace, day), k.usage_workspaces, k.usage_events,
                  k.doomed],
            args=[k.sandbox_prefix, k.session_prefix, session_id, workspace, pool, image, repr(now),
                  limits.idle_timeout_seconds, limits.max_lifetime_seconds, limits.exec_timeout_seconds,
                  limits.max_exec_timeout_seconds, max(0, max_concurrent), max(0, daily_budget),
                  1 if meter_capacity_refusal else 0, _RETENTION_SECONDS, USAGE_STREAM_MAXLEN,
                  KEY_EXPIRY_MARGIN_SECONDS, k.pool_events],
        )
        if result[0] == "ok":
            return Leased(sandbox=result[1], address=result[2], secret=result[3])
        return Refused(kind=result[0], limit=result[1] if len(result) > 1 else "capacity")

    async def touch(self, *, session_id: str, workspace: str, now: float, busy_for: float) -> Target | None:
        k = self.keys
        found = await self._touch(keys=[k.session(session_id), k.deadlines],
                                  args=[session_id, workspace, repr(now), repr(float(busy_for))])
        if not found:
            return None
        address, secret, exec_timeout, max_exec = found
        return Target(address=address, secret=secret, exec_timeout_seconds=int(exec_timeout),
                      max_exec_timeout_seconds=int(max_exec))

    async def done(self, *, session_id: str, workspace: str, now: float, event: str = "",
                   amounts: dict[str, int | float] | None = None) -> None:
        k = self.keys
        args: list[Any] = [session_id, workspace, repr(now), _RETENTION_SECONDS, USAGE_STREAM_MAXLEN, event]
        for field, amount in (amounts or {}).items():
            args += [field, f"{amount:.3f}" if isinstance(amount, float) else int(amount)]
        await self._done(
            keys=[k.session(session_id), k.deadlines, k.usage_total(workspace),
                  k.usage_day(workspace, utc_day(now)), k.usage_workspaces, k.usage_events],
            args=args,
        )

    async def release(self, *, session_id: str, workspace: str | None, now: float, mode: str) -> Released | None:
        """Release a session; `workspace=None` releases whoever owns it (the reaper, mode `reap`)."""
        k = self.keys
        day_head, day_tail = _split(k.usage_day(_HOLE, utc_day(now)))
        result = await self._release(
            keys=[k.session(session_id), k.deadlines, k.doomed, k.usage_workspaces, k.usage_events],
            args=[session_id, workspace or "", repr(now), mode, k.sandbox_prefix, *self._ws_sessions,
                  *self._usage_total, day_head, day_tail, _RETENTION_SECONDS, USAGE_STREAM_MAXLEN,
                  k.pool_events],
        )
        if not result:
            return None
        reason, seconds, address, sandbox = result
        return Released(reason=reason, session_seconds=float(seconds), address=address or "", sandbox=sandbox)

    async def due(self, now: float, limit: int) -> list[str]:
        """Session ids whose deadline has passed, oldest first (an index range, never a scan)."""
        return list(await self.redis.zrangebyscore(self.keys.deadlines, "-inf", now, start=0, num=limit))

    async def pool_counts(self, pool: str) -> PoolCounts:
        starting, ready, leased, doomed = await self._pool_stats(
            keys=[self.keys.pool_members(pool)], args=[self.keys.sandbox_prefix])
        return PoolCounts(int(starting), int(ready), int(leased), int(doomed))
