"""The sandbox records the pool controller keeps in Redis, and the steps that change them.

Each step of the sandbox lifecycle (`docs/architecture.md`) is one script; a
crash between two steps leaves a state reconciliation recognises (`starting`
too long, a member the provider does not run, a sandbox Redis does not know).
Every method raises `StateUnavailable` or `StateError`, never a Redis exception.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from sandpool.state import scripts
from sandpool.state.client import Client
from sandpool.state.errors import translated
from sandpool.state.keys import Keys
from sandpool.state.sessions import RATE_BUCKET_SECONDS, rate_bucket

CHUNK = 250
"""Records `records` reads per pipelined round trip, however many it is asked for."""

SURVEY_STEP = 100
"""Members reconciliation reads per script call (`survey`): each one's record and its session's, about 13 µs
of Redis: 250 per call held Redis 5-8 ms on a loaded machine."""
SWEEP_CHUNK = 500
"""Members one waiter sweep looks at (a few milliseconds of Redis time at most); the sweep goes on from
where it stopped on its next call."""

STATES = ("starting", "ready", "promised", "leased", "doomed")
"""What a sandbox record's `state` field may hold."""


@dataclass(frozen=True)
class PoolFill:
    ready: int
    members: int
    queued: int = 0  # waiters no sandbox is promised to yet: each wants one started
    waiters: int = 0  # waiters of any state (queued or promised): the controller sweeps them while any wait


@dataclass(frozen=True)
class Look:
    """What a pass of the leader's loop reads first, in one round trip: each pool's fill, and doomed
    sandboxes popped (up to `asked`: fewer means the set is empty now)."""

    fills: dict[str, PoolFill]
    doomed: list[str]
    asked: int


@dataclass(frozen=True)
class Lost:
    """What a sandbox the provider lost was doing: its state then, and its session ('' when none)."""

    state: str
    session: str


RECORD_FIELDS = ("state", "pool", "session", "owner", "created_at")
"""The fields of a sandbox hash a `SandboxRecord` holds: read by name (HMGET), not the whole hash, since
reconciliation reads every record and parsing the replies is most of its CPU (docs/capacity.md)."""


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
    def from_values(cls, sandbox_id: str, values: list[str | None]) -> SandboxRecord:
        """From the values of `RECORD_FIELDS`, in that order (None: the field is not there)."""
        return cls.from_fields(sandbox_id, {name: value for name, value in zip(RECORD_FIELDS, values, strict=True)
                                            if value is not None})

    @classmethod
    def from_fields(cls, sandbox_id: str, fields: dict[str, str]) -> SandboxRecord:
        return cls(sandbox_id, fields.get("state", ""), fields.get("pool", ""), fields.get("session", ""),
                   fields.get("owner", ""), _seconds(fields.get("created_at")))


def _seconds(value: str | None) -> float:
    """A time field as Redis holds it; 0 (as old as can be) when missing or unreadable."""
    try:
        return float(value or 0)
    except ValueError:
        return 0.0


@dataclass(frozen=True)
class Settled:
    """Members of one pool whose records are steady: `ready`, or `leased` to a session that names them
    (`held`, the session of each at the same index of `sessions`). Only the provider can make one of them
    need an action (it does not run it, or its agent is gone), so `survey` reads them as ids, not records:
    at 100,000 sandboxes nearly every member is one (docs/capacity.md)."""

    pool: str
    ready: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Survey:
    """What reconciliation reads of Redis (`SandboxStore.survey`)."""

    records: dict[str, SandboxRecord]
    """Every member of the pools read that is not settled, by sandbox id."""
    sessions: dict[str, str]
    """Session id -> the sandbox that session names ('' when the session is gone), for every session one of
    `records` names."""
    settled: list[Settled] = field(default_factory=list)
    """The rest of the members, by pool."""


class SandboxStore:
    def __init__(self, client: Client, keys: Keys, *, record_ttl_seconds: int) -> None:
        self.redis = client
        self.keys = keys
        self.record_ttl_ms = record_ttl_seconds * 1000
        self._register = client.register_script(scripts.REGISTER_STARTING)
        self._publish = client.register_script(scripts.PUBLISH_READY)
        self._forget = client.register_script(scripts.FORGET)
        self._retire = client.register_script(scripts.RETIRE_SURPLUS)
        self._sweep = client.register_script(scripts.SWEEP_WAITERS)
        self._lost = client.register_script(scripts.LOST)
        self._survey = client.register_script(scripts.SURVEY)

    @translated
    async def look(self, pools: Iterable[str], doomed: int) -> Look:
        """For each pool, how many of its sandboxes are ready, how many it has at all and who waits for
        one; and up to `doomed` doomed sandboxes popped: one pipelined round trip, not one per pool and
        another for the doomed set (the leader's loop reads this on every wake-up, ~3 a churned session)."""
        names = list(pools)
        async with self.redis.pipeline(transaction=False) as pipe:
            for pool in names:
                pipe.llen(self.keys.pool_ready(pool))
                pipe.scard(self.keys.pool_members(pool))
                pipe.scard(self.keys.pool_queued(pool))
                pipe.scard(self.keys.pool_waiters(pool))
            if doomed > 0:
                pipe.spop(self.keys.doomed, doomed)
            replies = await pipe.execute()
        fills = {pool: PoolFill(*(int(n) for n in replies[4 * i:4 * i + 4])) for i, pool in enumerate(names)}
        popped = [str(x) for x in replies[-1] or []] if doomed > 0 else []
        return Look(fills, popped, max(0, doomed))

    @translated
    async def lease_rate(self, pool: str, now: float, *, buckets: int = 6) -> float:
        """The pool's leases per second over the last `buckets` 10-second buckets (6: a minute; the
        counters are kept two minutes)."""
        bucket = rate_bucket(now)
        prefix = self.keys.pool_rate_prefix(pool, "leases")
        counts = await self.redis.mget([f"{prefix}{bucket - i}" for i in range(buckets)])
        return sum(int(c or 0) for c in counts) / (buckets * RATE_BUCKET_SECONDS)

    @translated
    async def record_error(self, pool: str, error: str, *, ttl_seconds: int = 300) -> None:
        """The provider's last error starting a sandbox of `pool`, for whoever answers `start_timeout`."""
        await self.redis.set(self.keys.pool_last_error(pool), error[:500], ex=ttl_seconds)

    @translated
    async def register_starting(self, sandbox_id: str, *, pool: str, image: str, ceiling: int, now: float,
                                owner: str) -> bool:
        """Record a sandbox about to be created; False when the pool is at its ceiling."""
        return bool(await self._register(
            keys=[self.keys.sandbox(sandbox_id), self.keys.pool_members(pool), self.keys.pool_starting(pool)],
            args=scripts.named(sandbox=sandbox_id, ceiling=ceiling, pool=pool, image=image, created_at=f"{now:.3f}",
                               owner=owner, record_ttl_ms=self.record_ttl_ms)))

    @translated
    async def publish_ready(self, sandbox_id: str, *, pool: str, address: str, secret: str, now: float,
                            egress_digest: str | None = None) -> bool:
        """Make a started sandbox leasable; False when it was forgotten or doomed meanwhile.
        `egress_digest` (`keys.egress_digest` of the sandbox's egress credential) is what the lease binds."""
        k = self.keys
        return bool(await self._publish(
            keys=[k.sandbox(sandbox_id), k.pool_ready(pool), k.pool_members(pool), k.pool_wait_ring(pool),
                  k.pool_queued(pool), k.pool_starting(pool)],
            args=scripts.named(sandbox=sandbox_id, address=address, secret=secret, ready_at=f"{now:.3f}",
                               record_ttl_ms=self.record_ttl_ms, queue_prefix=k.pool_wait_queue_prefix(pool),
                               waiter_prefix=k.waiter_prefix, promised=k.promised, egress=egress_digest or "")))

    @translated
    async def sweep_waiters(self, pool: str, cursor: str = "0") -> tuple[int, str]:
        """Forget waiters whose api replica vanished; hand on what was promised to them, looking at the
        next `SWEEP_CHUNK` members from `cursor`: (how many were put right, the cursor to go on from; '0' when
        every member has been looked at)."""
        k = self.keys
        fixed, following = await self._sweep(
            keys=[k.pool_waiters(pool), k.pool_queued(pool), k.pool_wait_ring(pool), k.pool_ready(pool),
                  k.pool_members(pool)],
            args=scripts.named(waiter_prefix=k.waiter_prefix, sandbox_prefix=k.sandbox_prefix,
                               queue_prefix=k.pool_wait_queue_prefix(pool), promised=k.promised, cursor=cursor,
                               count=SWEEP_CHUNK))
        return int(fixed), str(following)

    @translated
    async def lost(self, sandbox_id: str, pool: str) -> Lost:
        """The provider lost this sandbox: take it out of the ready list now and doom it (atomically with
        leases), queue its waiter again if it was promised; the session on it is the caller's to release."""
        k = self.keys
        state, session = await self._lost(
            keys=[k.sandbox(sandbox_id), k.pool_ready(pool), k.doomed, k.pool_queued(pool), k.pool_wait_ring(pool)],
            args=scripts.named(sandbox=sandbox_id, waiter_prefix=k.waiter_prefix,
                               queue_prefix=k.pool_wait_queue_prefix(pool), nudge=k.pool_events))
        return Lost(state=str(state), session=str(session))

    @translated
    async def forget(self, sandbox_id: str, pool: str) -> None:
        """Drop every trace of a sandbox (its record, memberships, queue entries)."""
        await self._forget(
            keys=[self.keys.sandbox(sandbox_id), self.keys.pool_members(pool), self.keys.pool_ready(pool),
                  self.keys.doomed, self.keys.pool_leased(pool), self.keys.pool_starting(pool)],
            args=scripts.named(sandbox=sandbox_id))

    @translated
    async def retire_surplus(self, pool: str, how_many: int) -> int:
        """Doom up to `how_many` ready sandboxes (the newest), atomically with leases."""
        return int(await self._retire(keys=[self.keys.pool_ready(pool), self.keys.doomed],
                                      args=scripts.named(sandbox_prefix=self.keys.sandbox_prefix,
                                                         how_many=how_many)))

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
    async def survey(self, pools: Iterable[str], *, rest: float = 0.0) -> Survey:
        """Every sandbox the pools own: the settled ones by id (`Settled`), the others with their record
        (`pool` the pool that owns it; `state` '' when the record is gone) and the sandbox each of their
        sessions names: what reconciliation judges by.
        Read `SURVEY_STEP` members per script call, so no call holds Redis for long at any size; after
        each, wait `rest` times as long as it took, so a background reader leaves Redis and the CPU it
        shares with the request path mostly to that path (a pass at full speed took about a core at
        100,000 sandboxes, and the request tails with it: docs/capacity.md)."""
        records: dict[str, SandboxRecord] = {}
        sessions: dict[str, str] = {}
        settled: list[Settled] = []
        k = self.keys
        prefixes = {"sandbox_prefix": k.sandbox_prefix, "session_prefix": k.session_prefix}
        for pool in sorted(set(pools)):
            steady = Settled(pool)
            settled.append(steady)
            steps = scripts.scan_steps(self._survey, keys=[k.pool_members(pool)], arguments=prefixes,
                                       count=SURVEY_STEP, rest=rest)
            async for ready, held, others in steps:
                steady.ready.extend(ready)
                steady.held.extend(held[0::2])
                steady.sessions.extend(held[1::2])
                if records:  # a set scan may return a member twice: the later read is the one kept
                    for sandbox_id in itertools.chain(ready, held[0::2]):
                        records.pop(sandbox_id, None)
                for i in range(0, len(others), 6):
                    sandbox_id, state, session, owner, created, named = others[i:i + 6]
                    records[sandbox_id] = SandboxRecord(sandbox_id, state or "", pool, session or "", owner or "",
                                                        _seconds(created))
                    if session:
                        sessions[session] = named or ""
        return Survey(records, sessions, settled)

    @translated
    async def records(self, sandbox_ids: list[str]) -> dict[str, SandboxRecord]:
        """The records of these sandboxes, `CHUNK` per round trip."""
        out: dict[str, SandboxRecord] = {}
        for start in range(0, len(sandbox_ids), CHUNK):
            chunk = sandbox_ids[start:start + CHUNK]
            async with self.redis.pipeline(transaction=False) as pipe:
                for sandbox_id in chunk:
                    pipe.hmget(self.keys.sandbox(sandbox_id), RECORD_FIELDS)
                raw = await pipe.execute()
            out.update((sid, SandboxRecord.from_values(sid, values)) for sid, values in zip(chunk, raw, strict=True))
        return out

    @translated
    async def session_on(self, session_id: str) -> str:
        """The sandbox a session is leased on ('' when the session is gone)."""
        return str(await self.redis.hget(self.keys.session(session_id), "sandbox") or "")

