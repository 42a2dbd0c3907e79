"""Sessions, leases and their usage in Redis: one script per state change, one round trip each.

Used by the session layer (lease, touch, done, release), the edge (an admin
ending a session, listing a workspace's sessions) and the controller (the
session reaper; releasing the session of a sandbox that vanished). Every method raises
`StateUnavailable` or `StateError`, never a Redis exception.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sandpool.contract import limits as catalogue
from sandpool.state import scripts
from sandpool.state.client import Client, acknowledged
from sandpool.state.errors import translated
from sandpool.state.keys import USAGE_DAY_RETENTION_DAYS, USAGE_STREAM_MAXLEN, Keys, utc_day

KEY_EXPIRY_MARGIN_SECONDS = 3600
"""Session keys expire this long after their max lifetime: a safety net behind the session reaper."""

RETENTION_SECONDS = USAGE_DAY_RETENTION_DAYS * 86400
_HOLE = "\x00"

HANDLE_FIELDS = ("workspace", "pool", "image", "created_at", "last_activity_at", "idle_timeout_seconds",
                 "max_lifetime_seconds", "exec_timeout_seconds", "max_exec_timeout_seconds", "limits")
"""Session hash fields a handle may show. Never `secret` or `address`."""

LIST_STEP = 200
"""Sessions a listing reads per script call (an SSCAN step): about 2 ms of Redis."""

_NO_LIMITS = {limit.name: 0 for limit in catalogue.counts(catalogue.handed_over())}
"""A handle names every lease limit; those not recorded are 0 (none)."""


def _split(template: str) -> tuple[str, str]:
    head, _, tail = template.partition(_HOLE)
    return head, tail


RATE_BUCKET_SECONDS = 10
RATE_WINDOW_TTL = 120
"""Seconds a workspace's per-minute request counter outlives its minute (clock skew between replicas)."""
NOT_ADMITTED = frozenset({"revoked", "unreadable", "rate", "policy"})



def _leased(result: Any) -> bool:
    """A lease or claim script leased a sandbox: what a replica must have before the answer (client.acknowledged)."""
    return bool(result) and result[0] == "ok"


def rate_bucket(now: float) -> int:
    """The 10-second bucket lease and release rates are counted in (a minute is six of them)."""
    return int(now // RATE_BUCKET_SECONDS)


@dataclass(frozen=True)
class SessionLimits:
    """What is in force for one session, reported on its handle."""

    idle_timeout_seconds: int
    max_lifetime_seconds: int
    exec_timeout_seconds: int
    max_exec_timeout_seconds: int


@dataclass(frozen=True)
class Leased:
    sandbox: str
    address: str
    secret: str


@dataclass(frozen=True)
class Refused:
    kind: str  # "capacity" | "quota"
    limit: str  # "at_capacity" or the name of the workspace limit that refused
    waiters: int = 0  # at capacity: how many callers the pool had promised slots to
    releases_per_minute: int = 0  # at capacity: the pool's releases over the last minute


@dataclass(frozen=True)
class Waiting:
    """No sandbox was ready: the caller is queued as waiter `waiter` (its session id) until one is
    promised to it (`claim`) or it gives up (`cancel_wait`). At a full pool it waits for `behind`
    releases (its own slot's and those of the waiters past the ceiling ahead of it) rather than a
    start, at the pool's recent `releases_per_minute`."""

    waiter: str
    behind: int = 0
    releases_per_minute: int = 0

    @property
    def past_ceiling(self) -> bool:
        return self.behind > 0

    def expected_seconds(self) -> float:
        """How long its releases take at the recent rate (0 below the ceiling)."""
        return self.behind * 60.0 / self.releases_per_minute if self.past_ceiling else 0.0


@dataclass(frozen=True)
class LeaseAdmission:
    """The edge's admission of a CreateSession, made by the lease's own round trip: the token's id (for
    its revocation), the rate window (`minute`, counted when `count`, against the operator's
    `rate_ceiling` and the stored policy's own limit), and the digest of the policy the lease was
    computed from (`policy_digest`, '' for none stored): under any other, nothing is leased."""

    jti: str | None
    minute: int
    count: bool
    rate_ceiling: int
    policy_digest: str


class NotAdmitted(Exception):
    """A lease's admission refused it (`revoked`, `unreadable`, `rate`) or found another policy in force
    than the lease was computed from (`policy`, with `policy_raw` the one in force): nothing was leased."""

    def __init__(self, verdict: str, count: int, policy_raw: str | None) -> None:
        super().__init__(verdict)
        self.verdict = verdict
        self.count = count
        self.policy_raw = policy_raw


def policy_digest(raw: str | None) -> str:
    """What a stored policy is known by in a lease's admission (SHA-1 of its JSON, as Redis computes it)."""
    return hashlib.sha1(raw.encode()).hexdigest() if raw else ""  # an identity, not a secret


@dataclass(frozen=True)
class CallSpec:
    """A call to a session about to be admitted: the id its record (and a cancel of it) is named by, how
    long it may keep the session busy, its tool ('' for a file call: not an execution), and how long
    past `busy_for` its record waits for its `done` before the controller settles it."""

    call_id: str
    busy_for: float
    tool: str = ""
    grace: float = 30.0


@dataclass(frozen=True)
class Target:
    """Where a session's calls go, and the exec timeouts in force for it."""

    address: str
    secret: str
    exec_timeout_seconds: int
    max_exec_timeout_seconds: int


def target_of(found: Sequence[str]) -> Target:
    """A touch script's answer `{address, secret, exec_timeout, max_exec_timeout}` as a `Target`."""
    address, secret, exec_timeout, max_exec = found[:4]
    return Target(address=address, secret=secret, exec_timeout_seconds=int(exec_timeout),
                  max_exec_timeout_seconds=int(max_exec))


@dataclass(frozen=True)
class Released:
    reason: str  # destroy | dead | idle | lifetime | unanswered | abandoned | admin
    session_seconds: float
    address: str
    sandbox: str
    workspace: str
    pool: str


@dataclass(frozen=True)
class Reaped:
    """A session the reaper released, and why (`idle`, `lifetime`, or `unanswered`: its CreateSession's
    answer was never confirmed sent)."""

    session_id: str
    reason: str
    session_seconds: float
    sandbox: str
    workspace: str


@dataclass(frozen=True)
class PoolCounts:
    starting: int
    ready: int
    leased: int
    doomed: int


def _number(value: str) -> int | float:
    try:
        return int(value)
    except ValueError:
        try:
            return float(value)
        except ValueError:
            return 0


def _handle(session_id: str, values: list[str | None], deadline: float | None) -> dict[str, Any]:
    record = dict(zip(HANDLE_FIELDS, values, strict=True))
    out: dict[str, Any] = {"session_id": session_id}
    for name, value in record.items():
        if value is None or name == "workspace":
            continue
        if name in ("pool", "image"):
            out[name] = value
        elif name == "limits":
            try:
                recorded = json.loads(value)
            except ValueError:
                continue
            # Recorded are the limits in force; the handle names every lease limit, 0 for none.
            out["limits"] = {**_NO_LIMITS, **recorded}
        else:
            out[name] = _number(value)
    out["deadline"] = deadline
    return out


class SessionStore:
    """Sessions in Redis, one script per state change."""

    def __init__(self, client: Client, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._lease = client.register_script(scripts.LEASE)
        self._answered = client.register_script(scripts.ANSWERED)
        self._admit_lease = client.register_script(scripts.ADMIT_LEASE)
        self._claim = client.register_script(scripts.CLAIM)
        self._cancel_wait = client.register_script(scripts.CANCEL_WAIT)
        self._workspace_sessions = client.register_script(scripts.WORKSPACE_SESSIONS)
        self._touch = client.register_script(scripts.TOUCH)
        self._done = client.register_script(scripts.DONE)
        self._release = client.register_script(scripts.RELEASE)
        self._reap = client.register_script(scripts.REAP)
        self._pool_stats = client.register_script(scripts.POOL_STATS)
        self._settle_overdue = client.register_script(scripts.SETTLE_OVERDUE)
        self._ws_sessions = _split(keys.workspace_sessions(_HOLE))
        self._usage_total = _split(keys.usage_total(_HOLE))
        self._pool_leased = _split(keys.pool_leased(_HOLE))
        self._release_rate = _split(keys.pool_rate_prefix(_HOLE, "releases"))

    @translated
    async def load_scripts(self) -> None:
        """Load every script up front so the first request pays no SCRIPT LOAD."""
        for script in (self._lease, self._answered, self._admit_lease, self._claim, self._cancel_wait, self._touch,
                       self._done, self._release, self._reap, self._pool_stats, self._settle_overdue):
            await self.redis.script_load(script.script)

    @translated
    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    @translated
    async def lease(self, *, session_id: str, workspace: str, pool: str, image: str, now: float,
                    limits: SessionLimits, workspace_limits: Mapping[str, int], ceiling: int = 1 << 30,
                    wait_seconds: float = 0.0, egress_allow: Sequence[str] = (),
                    admission: LeaseAdmission | None = None, answer_grace: float = 0.0) -> Leased | Waiting | Refused:
        """Lease a ready sandbox of `pool` for a new session, within the workspace's lease limits.

        With none ready and `wait_seconds` > 0, the caller is queued (`Waiting`) below the pool's
        `ceiling`, and at it when the pool's releases over the last minute would free a slot for
        the caller within half the wait; otherwise a full pool is a capacity refusal, metered. A sandbox with an egress
        credential has it bound to the session and `egress_allow` in the same script (a waiter's
        binding is made when it claims its sandbox). With `admission`, the edge's admission runs in the
        same script first (a warm CreateSession's one round trip); `NotAdmitted` when it refuses.
        With `answer_grace` > 0 the session is due that long after its lease (a waiter's: its claim)
        until `answered` confirms the caller was told of it."""
        k = self.keys
        request = {
            "session": session_id, "workspace": workspace, "pool": pool, "image": image, "now": repr(now),
            "idle": limits.idle_timeout_seconds, "lifetime": limits.max_lifetime_seconds,
            "exec": limits.exec_timeout_seconds, "max_exec": limits.max_exec_timeout_seconds,
            # Only the limits in force (0 is none): the session hash stays within Redis's compact
            # encoding (a value over 64 bytes makes it a hashtable, 1,073 bytes instead of about 400).
            "limits": {name: int(value) for name, value in workspace_limits.items() if int(value)},
            "ceiling": ceiling, "wait": wait_seconds, "bucket": rate_bucket(now),
            "lease_rate_prefix": k.pool_rate_prefix(pool, "leases"),
            "release_rate_prefix": k.pool_rate_prefix(pool, "releases"),
            "retention": RETENTION_SECONDS, "maxlen": USAGE_STREAM_MAXLEN, "expiry_margin": KEY_EXPIRY_MARGIN_SECONDS,
            "nudge": k.pool_events, "sandbox_prefix": k.sandbox_prefix, "session_prefix": k.session_prefix,
            "waiter_prefix": k.waiter_prefix,
            "egress_allow": json.dumps(list(egress_allow), separators=(",", ":")),
            "egress_prefix": k.egress_binding_prefix, "answer": answer_grace,
        }
        lease_keys = [k.pool_ready(pool), k.session(session_id), k.deadlines, k.workspace_sessions(workspace),
                      k.usage_total(workspace), k.usage_day(workspace, utc_day(now)), k.usage_workspaces,
                      k.usage_events, k.doomed, k.pool_leased(pool), k.pool_waiters(pool), k.pool_queued(pool),
                      k.pool_wait_ring(pool), k.pool_wait_queue(pool, workspace), k.waiter(session_id),
                      k.workspace_waiters(workspace)]
        if admission is None:
            result = await acknowledged(self.redis, self._lease, keys=lease_keys, args=scripts.named(**request),
                                        when=_leased)
        else:
            edge_keys = [k.rate(workspace, admission.minute), k.workspace_policy(workspace)]
            if admission.jti is not None:
                edge_keys.append(k.revoked(admission.jti))
            result = await acknowledged(
                self.redis, self._admit_lease,
                keys=lease_keys + edge_keys,
                args=scripts.named(lease=request, count=admission.count, expiry=RATE_WINDOW_TTL,
                                   rate_ceiling=admission.rate_ceiling, policy_digest=admission.policy_digest),
                when=_leased)
            if result[0] in NOT_ADMITTED:
                raise NotAdmitted(result[0], int(result[1]), result[2] or None)
        if result[0] == "ok":
            return Leased(sandbox=result[1], address=result[2], secret=result[3])
        if result[0] == "wait":
            return Waiting(waiter=session_id, behind=int(result[1]), releases_per_minute=int(result[2]))
        if result[0] == "capacity":
            return Refused(kind="capacity", limit="at_capacity", waiters=int(result[1]),
                           releases_per_minute=int(result[2]))
        return Refused(kind=result[0], limit=result[1])

    @translated
    async def answered(self, session_ids: Sequence[str]) -> int:
        """The CreateSessions of these sessions were answered: each is due at its idle timeout from its
        creation (or later, if a call already pushed it), no longer at the answer's grace. Returns how many
        were still live."""
        return int(await acknowledged(self.redis, self._answered, keys=[self.keys.deadlines],
                                      args=scripts.named(session_prefix=self.keys.session_prefix,
                                                         sessions=list(session_ids)),
                                      when=lambda confirmed: int(confirmed) > 0))

    @translated
    async def claim(self, *, waiter: str, workspace: str, pool: str, now: float) -> Leased | Waiting | None:
        """Take the sandbox promised to `waiter` as its session; `Waiting` while none is, None when the
        waiter is gone (it expired)."""
        k = self.keys
        result = await acknowledged(
            self.redis, self._claim,
            keys=[k.waiter(waiter), k.session(waiter), k.deadlines, k.workspace_sessions(workspace),
                  k.usage_total(workspace), k.usage_day(workspace, utc_day(now)), k.usage_workspaces,
                  k.usage_events, k.pool_leased(pool), k.pool_waiters(pool), k.workspace_waiters(workspace),
                  k.pool_queued(pool), k.pool_wait_ring(pool), k.pool_wait_queue(pool, workspace)],
            args=scripts.named(now=repr(now), bucket=rate_bucket(now), workspace=workspace),
            when=_leased,
        )
        if result[0] == "ok":
            return Leased(sandbox=result[1], address=result[2], secret=result[3])
        return Waiting(waiter=waiter) if result[0] == "waiting" else None

    @translated
    async def cancel_wait(self, *, waiter: str, workspace: str, pool: str, now: float, refusal: str = "") -> None:
        """Stop waiting; a sandbox already promised goes to the next waiter or back to the ready list.
        `refusal`: the wait ran out, metered as a capacity refusal with this limit (`start_timeout`,
        or `at_capacity` for a caller that waited past the ceiling)."""
        k = self.keys
        request = {"waiter": waiter, "workspace": workspace, "pool": pool, "now": repr(now), "refusal": refusal,
                   "retention": RETENTION_SECONDS, "maxlen": USAGE_STREAM_MAXLEN, "sandbox_prefix": k.sandbox_prefix,
                   "queue_prefix": k.pool_wait_queue_prefix(pool), "waiter_prefix": k.waiter_prefix,
                   "promised": k.promised}
        await self._cancel_wait(
            keys=[k.waiter(waiter), k.pool_waiters(pool), k.pool_queued(pool), k.pool_wait_ring(pool),
                  k.pool_wait_queue(pool, workspace), k.workspace_waiters(workspace), k.pool_ready(pool),
                  k.usage_total(workspace), k.usage_day(workspace, utc_day(now)), k.usage_workspaces,
                  k.usage_events],
            args=scripts.named(**request))

    @translated
    async def promised(self, waiters: list[str]) -> set[str]:
        """Which of these waiters have a sandbox promised (or are gone: they must look), in one round trip."""
        if not waiters:
            return set()
        async with self.redis.pipeline(transaction=False) as pipe:
            for waiter in waiters:
                pipe.hget(self.keys.waiter(waiter), "state")
            states = await pipe.execute()
        return {waiter for waiter, state in zip(waiters, states, strict=True) if state != "queued"}

    @translated
    async def last_error(self, pool: str) -> str:
        """The provider's last error starting a sandbox of `pool` ('' when none is recorded)."""
        return str(await self.redis.get(self.keys.pool_last_error(pool)) or "")

    @translated
    async def touch(self, *, session_id: str, workspace: str, now: float, call: CallSpec) -> Target | None:
        """Resolve a session for a call and record the call (None: unknown, expired, or another workspace's;
        nothing recorded)."""
        k = self.keys
        found = await self._touch(keys=[k.session(session_id), k.deadlines, k.call(call.call_id), k.call_deadlines],
                                  args=scripts.named(session=session_id, workspace=workspace, now=repr(now),
                                                     busy_for=float(call.busy_for), call=call.call_id, tool=call.tool,
                                                     grace=float(call.grace)))
        return target_of(found) if found else None

    @translated
    async def done(self, *, call_id: str, session_id: str, workspace: str, now: float, event: str = "",
                   tool: str = "", amounts: Mapping[str, int | float] | None = None) -> bool:
        """A call ended: meter `amounts` (totals, and per tool when `tool` is given), mark the session
        active, remove the call's record. False when the record was gone (sent twice, or settled by the
        controller): nothing was done again."""
        k = self.keys
        pairs = [[field, f"{amount:.3f}" if isinstance(amount, float) else int(amount)]
                 for field, amount in (amounts or {}).items()]
        settled = await self._done(
            keys=[k.call(call_id), k.call_deadlines, k.session(session_id), k.deadlines, k.usage_total(workspace),
                  k.usage_day(workspace, utc_day(now)), k.usage_workspaces, k.usage_events],
            args=scripts.named(call=call_id, session=session_id, workspace=workspace, now=repr(now),
                               retention=RETENTION_SECONDS, maxlen=USAGE_STREAM_MAXLEN, event=event, tool=tool,
                               amounts=pairs),
        )
        return bool(int(settled))

    @translated
    async def settle_overdue(self, now: float, limit: int) -> tuple[int, int]:
        """Settle up to `limit` calls whose `done` is overdue (their api crashed): (settled, of which
        executions metered as unconfirmed)."""
        k = self.keys
        day_head, day_tail = _split(k.usage_day(_HOLE, utc_day(now)))
        settled, metered = await self._settle_overdue(
            keys=[k.call_deadlines, k.deadlines, k.usage_workspaces, k.usage_events],
            args=scripts.named(now=repr(now), limit=limit, call_prefix=k.call_prefix, session_prefix=k.session_prefix,
                               total=self._usage_total, day=[day_head, day_tail], retention=RETENTION_SECONDS,
                               maxlen=USAGE_STREAM_MAXLEN))
        return int(settled), int(metered)

    def _release_arguments(self, now: float) -> dict[str, Any]:
        """release.lua's arguments that do not depend on the session (reap.lua's too)."""
        k = self.keys
        day_head, day_tail = _split(k.usage_day(_HOLE, utc_day(now)))
        return dict(now=repr(now), sandbox_prefix=k.sandbox_prefix, retention=RETENTION_SECONDS,
                    maxlen=USAGE_STREAM_MAXLEN, nudge=k.pool_events, released=k.released_sessions,
                    egress_prefix=k.egress_binding_prefix, ws_sessions=self._ws_sessions, total=self._usage_total,
                    day=[day_head, day_tail], leased=self._pool_leased,
                    releases=[self._release_rate[0], self._release_rate[1] + str(rate_bucket(now))])

    @translated
    async def reap(self, now: float, limit: int) -> tuple[int, list[Reaped]]:
        """Release up to `limit` sessions whose deadline has passed, in one round trip: (how many ids were
        due, the sessions released). Fewer due than `limit`: nothing more is due now."""
        k = self.keys
        result = await self._reap(keys=[k.deadlines, k.doomed, k.usage_workspaces, k.usage_events],
                                  args=scripts.named(limit=limit, session_prefix=k.session_prefix,
                                                     **self._release_arguments(now)))
        return int(result[0]), [Reaped(session_id=sid, reason=reason, session_seconds=float(seconds), sandbox=sandbox,
                                       workspace=workspace) for sid, reason, seconds, sandbox, workspace in result[1:]]

    @translated
    async def release(self, *, session_id: str, workspace: str | None, now: float, mode: str) -> Released | None:
        """Release a session; `workspace=None` releases whoever owns it (the session reaper, an admin). Its
        sandbox's egress credential is unbound in the same script."""
        k = self.keys
        result = await self._release(
            keys=[k.session(session_id), k.deadlines, k.doomed, k.usage_workspaces, k.usage_events],
            args=scripts.named(session=session_id, workspace=workspace or "", mode=mode,
                               **self._release_arguments(now)))
        if not result:
            return None
        reason, seconds, address, sandbox, owner, pool = result
        return Released(reason=reason, session_seconds=float(seconds), address=address or "", sandbox=sandbox,
                        workspace=owner, pool=pool or "")

    @translated
    async def handle(self, session_id: str, *, workspace: str | None) -> dict[str, Any] | None:
        """A session's handle (what is in force, its times and deadline); None when unknown or, with
        `workspace`, another workspace's. Reading it is not activity: nothing is touched."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self.keys.session(session_id), HANDLE_FIELDS)
            pipe.zscore(self.keys.deadlines, session_id)
            values, deadline = await pipe.execute()
        owner = values[0]
        if owner is None or (workspace is not None and owner != workspace):
            return None
        handle = _handle(session_id, values, deadline)
        handle["workspace"] = owner
        return handle

    @translated
    async def of_workspace(self, workspace: str, limit: int) -> list[dict[str, Any]]:
        """The workspace's live sessions (handles, sorted by id); stale set members are skipped. Read
        `LIST_STEP` per script call: each call's reply is parsed in C, not built command by command."""
        k = self.keys
        width = 2 + len(HANDLE_FIELDS)
        out: list[dict[str, Any]] = []
        seen = 0
        steps = scripts.scan_steps(self._workspace_sessions, keys=[k.workspace_sessions(workspace), k.deadlines],
                                   arguments={"session_prefix": k.session_prefix, "fields": HANDLE_FIELDS},
                                   count=LIST_STEP)
        async for flat in steps:
            for start in range(0, len(flat), width):
                if seen >= limit:
                    break
                seen += 1
                session_id, deadline, values = flat[start], flat[start + 1], flat[start + 2:start + width]
                if values[0] != workspace:
                    continue  # released meanwhile, or not this workspace's: never show it
                out.append(_handle(session_id, values, None if deadline is None else float(deadline)))
            if seen >= limit:
                break
        return sorted(out, key=lambda item: item["session_id"])

    @translated
    async def pool_counts(self, pool: str) -> PoolCounts:
        k = self.keys
        starting, ready, leased, doomed = await self._pool_stats(
            keys=[k.pool_members(pool), k.pool_ready(pool), k.pool_leased(pool), k.pool_starting(pool),
                  k.pool_waiters(pool), k.pool_queued(pool)], args=scripts.named())
        return PoolCounts(int(starting), int(ready), int(leased), int(doomed))


