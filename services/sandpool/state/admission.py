"""What the edge keeps in Redis: workspace policies, revoked tokens, and the rate windows.

Per contract request the edge makes exactly one round trip: it checks the
token's revocation marker, counts the request in the workspace's rate window
and reads the workspace's policy, atomically, in one script (`admit`). A call
to a session (Execute and the file calls) also resolves and touches the session
in that same script (`admit_call`), so it reaches the agent after one round trip. The rate
counter is a fixed UTC-minute window shared by every api replica, so the
limit is exact however many replicas run.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandpool.state import scripts
from sandpool.state.client import Client
from sandpool.state.errors import translated
from sandpool.state.keys import Keys
from sandpool.state.sessions import RATE_WINDOW_TTL, CallSpec, Target, target_of


@dataclass(frozen=True)
class Admission:
    revoked: bool
    count: int
    policy_raw: str | None


@dataclass(frozen=True)
class CallAdmission:
    """The verdict of `admit_call`: `revoked`, `unreadable` (policy), `rate`, `unknown` or `ok` (with
    the session's `target`)."""

    verdict: str
    count: int
    policy_raw: str | None
    target: Target | None = None


class AdmissionStore:
    def __init__(self, client: Client, keys: Keys) -> None:
        self.redis = client
        self.keys = keys
        self._admit = client.register_script(scripts.ADMIT)
        self._admit_call = client.register_script(scripts.ADMIT_CALL)

    @translated
    async def admit(self, workspace: str, jti: str | None, minute: int, *, count: bool) -> Admission:
        """Revocation, the rate window (counting this request when `count`) and the policy, at once."""
        keys = [self.keys.rate(workspace, minute), self.keys.workspace_policy(workspace)]
        if jti is not None:
            keys.append(self.keys.revoked(jti))
        revoked, n, policy = await self._admit(keys=keys, args=scripts.named(count=count, expiry=RATE_WINDOW_TTL))
        return Admission(revoked=bool(int(revoked)), count=int(n), policy_raw=policy or None)

    @translated
    async def admit_call(self, workspace: str, jti: str | None, minute: int, *, count: bool, rate_ceiling: int,
                         session_id: str, now: float, call: CallSpec) -> CallAdmission:
        """`admit`, the rate decided here too, the session's touch and the call's record (as
        `SessionStore.touch`), at once."""
        k = self.keys
        keys = [k.rate(workspace, minute), k.workspace_policy(workspace), k.session(session_id), k.deadlines,
                k.call(call.call_id), k.call_deadlines]
        if jti is not None:
            keys.append(k.revoked(jti))
        found = await self._admit_call(keys=keys, args=scripts.named(
            count=count, expiry=RATE_WINDOW_TTL, rate_ceiling=rate_ceiling, session=session_id, workspace=workspace,
            now=repr(now), busy_for=float(call.busy_for), call=call.call_id, tool=call.tool, grace=float(call.grace)))
        verdict, n, policy = found[0], int(found[1]), found[2] or None
        target = target_of(found[3:7]) if verdict == "ok" else None
        return CallAdmission(verdict=verdict, count=n, policy_raw=policy, target=target)

    @translated
    async def is_revoked(self, jti: str) -> bool:
        return bool(await self.redis.exists(self.keys.revoked(jti)))

    @translated
    async def revoke(self, jti: str, ttl_seconds: int) -> None:
        await self.redis.set(self.keys.revoked(jti), "1", ex=max(1, ttl_seconds))

    @translated
    async def get_policy(self, workspace: str) -> str | None:
        raw = await self.redis.get(self.keys.workspace_policy(workspace))
        return str(raw) if raw is not None else None

    @translated
    async def put_policy(self, workspace: str, raw: str) -> None:
        await self.redis.set(self.keys.workspace_policy(workspace), raw)
