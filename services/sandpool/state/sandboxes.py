"""The sandbox records the pool controller keeps in Redis, and the steps that change them.

Each step of the sandbox lifecycle (`docs/architecture.md`) is one script; a
crash between two steps leaves a state reconciliation recognises (`starting`
too long, a member the provider does not run, a sandbox Redis does not know).
Every method raises `StateUnavailable` or `StateError`, never a Redis exception.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sandpool.state import scripts
from sandpool.state.client import Client
from sandpool.state.errors import translated
from sandpool.state.keys import Keys

STATES = ("starting", "ready", "leased", "doomed")
"""What a sandbox record's `state` field may hold."""


@dataclass(frozen=True)
class PoolFill:
    ready: int
    members: int


@dataclass(frozen=True)
class SandboxRecord:
    """A sandbox as Redis knows it ('' for a field it does not have)."""

    sandbox_id: str
    state: str
    pool: str = ""
    session: str = ""
    owner: str = ""
    created_at: float = 0.0

    @classmethod
    def from_fields(cls, sandbox_id: str, fields: dict[str, str]) -> SandboxRecord:
        try:
            created = float(fields.get("created_at") or 0)
        except ValueError:
            created = 0.0
        return cls(sandbox_id, fields.get("state", ""), fields.get("pool", ""), fields.get("session", ""),
                   fields.get("owner", ""), created)


class SandboxStore:
    def __init__(self, client: Client, keys: Keys, *, record_ttl_seconds: int) -> None:
        self.redis = client
        self.keys = keys
        self.record_ttl_ms = record_ttl_seconds * 1000
        self._register = client.register_script(scripts.REGISTER_STARTING)
        self._publish = client.register_script(scripts.PUBLISH_READY)
        self._forget = client.register_script(scripts.FORGET)
        self._retire = client.register_script(scripts.RETIRE_SURPLUS)

    @translated
    async def fill(self, pool: str) -> PoolFill:
        """How many of the pool's sandboxes are ready, and how many it has at all."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.llen(self.keys.pool_ready(pool))
            pipe.scard(self.keys.pool_members(pool))
            ready, members = await pipe.execute()
        return PoolFill(int(ready), int(members))

    @translated
    async def register_starting(self, sandbox_id: str, *, pool: str, image: str, ceiling: int, now: float,
                                owner: str) -> bool:
        """Record a sandbox about to be created; False when the pool is at its ceiling."""
        return bool(await self._register(
            keys=[self.keys.sandbox(sandbox_id), self.keys.pool_members(pool)],
            args=[sandbox_id, ceiling, pool, image, f"{now:.3f}", owner, self.record_ttl_ms]))

    @translated
    async def publish_ready(self, sandbox_id: str, *, pool: str, address: str, secret: str, now: float) -> bool:
        """Make a started sandbox leasable; False when it was forgotten or doomed meanwhile."""
        return bool(await self._publish(
            keys=[self.keys.sandbox(sandbox_id), self.keys.pool_ready(pool), self.keys.pool_members(pool)],
            args=[sandbox_id, address, secret, f"{now:.3f}", self.record_ttl_ms]))

    @translated
    async def forget(self, sandbox_id: str, pool: str) -> None:
        """Drop every trace of a sandbox (its record, memberships, queue entries)."""
        await self._forget(
            keys=[self.keys.sandbox(sandbox_id), self.keys.pool_members(pool), self.keys.pool_ready(pool),
                  self.keys.doomed, self.keys.pool_leased(pool)],
            args=[sandbox_id])

    @translated
    async def retire_surplus(self, pool: str, how_many: int) -> int:
        """Doom up to `how_many` ready sandboxes (the newest), atomically with leases."""
        return int(await self._retire(keys=[self.keys.pool_ready(pool), self.keys.doomed],
                                      args=[self.keys.sandbox_prefix, how_many]))

    @translated
    async def pop_doomed(self, how_many: int) -> list[str]:
        return [str(x) for x in await self.redis.spop(self.keys.doomed, how_many) or []]

    @translated
    async def doom_again(self, sandbox_id: str) -> None:
        """Put a sandbox back on the doomed set (a destroy to retry later)."""
        await self.redis.sadd(self.keys.doomed, sandbox_id)

    @translated
    async def pool_of(self, sandbox_id: str) -> str:
        return str(await self.redis.hget(self.keys.sandbox(sandbox_id), "pool") or "")

    @translated
    async def members(self, pools: Iterable[str]) -> dict[str, str]:
        """Every sandbox id the pools own, with its pool."""
        found: dict[str, str] = {}
        for pool in sorted(set(pools)):
            for sandbox_id in await self.redis.smembers(self.keys.pool_members(pool)):
                found[str(sandbox_id)] = pool
        return found

    @translated
    async def records(self, sandbox_ids: list[str]) -> dict[str, SandboxRecord]:
        if not sandbox_ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for sandbox_id in sandbox_ids:
                pipe.hgetall(self.keys.sandbox(sandbox_id))
            raw = await pipe.execute()
        return {sid: SandboxRecord.from_fields(sid, {str(k): str(v) for k, v in fields.items()})
                for sid, fields in zip(sandbox_ids, raw)}

    @translated
    async def session_on(self, session_id: str) -> str:
        """The sandbox a session is leased on ('' when the session is gone)."""
        return str(await self.redis.hget(self.keys.session(session_id), "sandbox") or "")

