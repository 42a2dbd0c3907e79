"""The proxy's Redis adapter: the only proxy module that imports `redis`.

Per contract request the proxy makes exactly one round trip (`admit`): it checks
the token's revocation marker, counts the request in the workspace's rate
window and reads the workspace's policy, atomically, in one Lua script. The
rate counter is a fixed UTC-minute window shared by every proxy replica, so the
limit is exact however many replicas run. Everything else here serves the
admin API and reads what the scheduler wrote (usage counters, live sessions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sandpool.state.keys import Keys

RATE_WINDOW_TTL = 120  # seconds a minute's counter outlives its minute (clock skew between replicas)

# KEYS[1] rate counter of (workspace, UTC minute)    KEYS[2] the workspace's policy (JSON string)
# KEYS[3] optional: the token's revocation marker
# ARGV[1] '1' to count this request against the rate, '0' not to    ARGV[2] counter expiry, seconds
# Returns {revoked 0|1, count after this request (0 when not counted or revoked), policy JSON or ''}.
# A revoked token is refused before it is counted, so it cannot spend the workspace's rate.
ADMIT = """
if #KEYS >= 3 and redis.call('EXISTS', KEYS[3]) == 1 then
  return {1, 0, ''}
end
local count = 0
if ARGV[1] == '1' then
  count = redis.call('INCR', KEYS[1])
  if count == 1 then
    redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
  end
end
local policy = redis.call('GET', KEYS[2])
if not policy then
  policy = ''
end
return {0, count, policy}
"""

SESSION_FIELDS = ("workspace", "pool", "image", "created_at", "last_activity_at", "idle_timeout_seconds",
                  "max_lifetime_seconds", "exec_timeout_seconds")
"""Session hash fields the admin API may show. Never `secret` or `address`."""


class StoreError(Exception):
    """Redis could not answer (down, timed out, refused)."""


@dataclass(frozen=True)
class Admission:
    revoked: bool
    count: int
    policy_raw: str | None


def _number(value: str) -> int | float:
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            return 0


class ProxyStore:
    def __init__(self, url: str, prefix: str, *, timeout: float, max_connections: int = 256) -> None:
        self.keys = Keys(prefix)
        self.redis = aioredis.from_url(url, decode_responses=True, socket_timeout=timeout,
                                       socket_connect_timeout=timeout, max_connections=max_connections,
                                       health_check_interval=30)
        self._admit = self.redis.register_script(ADMIT)

    async def close(self) -> None:
        await self.redis.aclose()

    async def ping(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError, TimeoutError):
            return False

    async def admit(self, workspace: str, jti: str | None, minute: int, *, count: bool) -> Admission:
        keys = [self.keys.rate(workspace, minute), self.keys.workspace_policy(workspace)]
        if jti is not None:
            keys.append(self.keys.revoked(jti))
        try:
            revoked, n, policy = await self._admit(keys=keys, args=["1" if count else "0", RATE_WINDOW_TTL])
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError(str(exc) or type(exc).__name__) from exc
        return Admission(revoked=bool(int(revoked)), count=int(n), policy_raw=policy or None)

    async def is_revoked(self, jti: str) -> bool:
        return bool(await self._call(self.redis.exists(self.keys.revoked(jti))))

    async def revoke(self, jti: str, ttl_seconds: int) -> None:
        await self._call(self.redis.set(self.keys.revoked(jti), "1", ex=max(1, ttl_seconds)))

    async def get_policy(self, workspace: str) -> str | None:
        return await self._call(self.redis.get(self.keys.workspace_policy(workspace)))

    async def put_policy(self, workspace: str, raw: str) -> None:
        await self._call(self.redis.set(self.keys.workspace_policy(workspace), raw))

    async def usage(self, workspace: str, days: list[str]) -> tuple[dict[str, int | float], list[dict[str, Any]]]:
        """Totals and the per-day counters of `days` (absent days read as empty)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.usage_total(workspace))
            for day in days:
                pipe.hgetall(self.keys.usage_day(workspace, day))
            results = await self._call(pipe.execute())
        total = {k: _number(v) for k, v in results[0].items()}
        per_day = [{"day": day, "counters": {k: _number(v) for k, v in raw.items()}}
                   for day, raw in zip(days, results[1:])]
        return total, per_day

    async def sessions(self, workspace: str, limit: int) -> list[dict[str, Any]]:
        """The workspace's live sessions with their reaping deadline; stale set members are skipped."""
        ids: list[str] = []
        try:
            async for session_id in self.redis.sscan_iter(self.keys.workspace_sessions(workspace), count=500):
                ids.append(session_id)
                if len(ids) >= limit:
                    break
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError(str(exc) or type(exc).__name__) from exc
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                pipe.hmget(self.keys.session(session_id), SESSION_FIELDS)
                pipe.zscore(self.keys.deadlines, session_id)
            results = await self._call(pipe.execute())
        out = []
        for index, session_id in enumerate(ids):
            values, deadline = results[2 * index], results[2 * index + 1]
            record = dict(zip(SESSION_FIELDS, values))
            if record.pop("workspace") != workspace:
                continue  # released meanwhile, or not this workspace's: never show it
            item: dict[str, Any] = {"session_id": session_id}
            for name, value in record.items():
                if value is None:
                    continue
                item[name] = value if name in ("pool", "image") else _number(value)
            item["deadline"] = deadline
            out.append(item)
        return sorted(out, key=lambda item: item["session_id"])

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreError(str(exc) or type(exc).__name__) from exc
