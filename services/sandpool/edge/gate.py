"""Who may pass, and under which limits: authentication, revocation, rate and policy for one request.

A contract request costs one signature check the first time its token is seen
and one Redis round trip every time (revocation + rate + policy in one script).
Every refusal is a named error: 401 with `WWW-Authenticate: Bearer`, 429 with
`Retry-After` naming the limit, 503 when Redis cannot be asked (fail closed:
without Redis neither revocation nor the rate can be checked).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from starlette.requests import Request

from sandpool.core.errors import QuotaExceeded, StateStoreUnavailable, Unauthorized, Unavailable
from sandpool.edge.auth import AuthFailure, Principal, TokenVerifier
from sandpool.edge.keyring import KeyRing
from sandpool.edge.policy import CorruptPolicy, Effective, PolicyCodec
from sandpool.sessions.metrics import ApiMetrics
from sandpool.state import Client, StateError
from sandpool.state.admission import AdmissionStore
from sandpool.state.egress import EgressStore
from sandpool.state.sessions import CallSpec, LeaseAdmission, NotAdmitted, SessionStore, Target, policy_digest
from sandpool.state.usage import UsageStore


@dataclass(frozen=True)
class Stores:
    """The edge's view of shared state: admission, usage, sessions (an admin ends one), and the egress
    ceiling the egress proxy published (an admin's egress allow-list must stay within it)."""

    client: Client
    admission: AdmissionStore
    usage: UsageStore
    sessions: SessionStore
    egress: EgressStore

log = logging.getLogger(__name__)

KNOWN_POLICIES = 4096
"""Workspaces whose last-read policy a replica keeps for the lease's own admission (least recent go)."""


@dataclass(frozen=True)
class KnownPolicy:
    """A workspace's policy as last read from Redis: its digest, and the values it puts in force."""

    digest: str
    effective: Effective


class Gate:
    def __init__(self, *, verifier: TokenVerifier, keyring: KeyRing, stores: Stores, codec: PolicyCodec,
                 metrics: ApiMetrics, jwks_client: httpx.AsyncClient | None,
                 ceilings: Mapping[str, int] | None = None) -> None:
        self.verifier = verifier
        self.ceilings = dict(ceilings or {})
        """Every numeric limit's ceiling in force here, by name (the admin API's policy view and checks)."""
        self.keyring = keyring
        self.stores = stores
        self.codec = codec
        self.metrics = metrics
        self.jwks_client = jwks_client
        self._known: OrderedDict[str, KnownPolicy] = OrderedDict()

    def refuse(self, failure: AuthFailure) -> Unauthorized:
        self.metrics.auth_failures.labels(failure.reason).inc()
        log.info("credential refused", extra={"reason": failure.reason})
        return Unauthorized(failure.detail, cause=failure.reason)

    async def principal(self, request: Request) -> Principal:
        """The verified caller (signature, claims; revocation is checked by `admit`/`not_revoked`)."""
        authorization = request.headers.get("authorization")
        try:
            return self.verifier.authenticate(authorization)
        except AuthFailure as failure:
            if failure.reason != "unknown_key" or not await self.keyring.refresh(self.jwks_client):
                raise self.refuse(failure) from None
        try:  # a kid nobody knew may have just been rotated into the JWKS document
            return self.verifier.authenticate(authorization)
        except AuthFailure as failure:
            raise self.refuse(failure) from None

    def store_failed(self, exc: StateError) -> Unavailable:
        """Count and log a Redis failure; the 503 to answer with."""
        self.metrics.redis_error()
        log.warning("redis call failed", extra={"error": str(exc)})
        return StateStoreUnavailable("the api cannot reach its state store", retry_after=1)

    async def admit(self, principal: Principal, *, count: bool = True) -> Effective:
        """Revocation, rate and policy in one round trip; the values in force for this request.

        `count=False` (DestroySession) neither counts against nor is refused by the rate:
        ending a session frees resources and is always allowed.
        """
        now = time.time()
        minute = int(now // 60)
        try:
            admission = await self.stores.admission.admit(principal.workspace, principal.jti, minute, count=count)
        except StateError as exc:
            raise self.store_failed(exc) from None
        if admission.revoked:
            raise self.refuse(AuthFailure("revoked", "the token has been revoked"))
        effective = self._decode(principal, admission.policy_raw)
        limit = effective.requests_per_minute
        if count and limit and admission.count > limit:
            raise self._over_rate(limit, minute, now)
        return effective

    async def admit_call(self, principal: Principal, session_id: str, *, call: CallSpec,
                         count: bool = True) -> tuple[Effective, Target | None]:
        """`admit`, the session's touch and the call's record in the same round trip (a call to a session
        reaches its agent after one); the session's target, None when it is unknown or another
        workspace's. Refused (revoked, over the rate, an unreadable policy) before anything of the
        session is touched or recorded."""
        now = time.time()
        minute = int(now // 60)
        try:
            admission = await self.stores.admission.admit_call(
                principal.workspace, principal.jti, minute, count=count, session_id=session_id, now=now,
                call=call, rate_ceiling=self.codec.proxy_ceilings.get("requests_per_minute", 0))
        except StateError as exc:
            raise self.store_failed(exc) from None
        if admission.verdict == "revoked":
            raise self.refuse(AuthFailure("revoked", "the token has been revoked"))
        if admission.verdict == "unreadable":
            raise self._unreadable(principal)
        try:
            effective = self._decode(principal, admission.policy_raw)
        except Unavailable:
            if admission.target is not None:  # readable JSON, yet no policy: give the touch back
                await self._untouch(principal, session_id, call)
            raise
        if admission.verdict == "rate":
            raise self._over_rate(effective.requests_per_minute, minute, now)
        return effective, admission.target

    def _decode(self, principal: Principal, raw: str | None) -> Effective:
        """The values a stored policy puts in force, remembered for the workspace's next CreateSession."""
        try:
            effective = self.codec.decode(raw)
        except CorruptPolicy:
            self._known.pop(principal.workspace, None)
            raise self._unreadable(principal) from None
        self._known[principal.workspace] = KnownPolicy(policy_digest(raw), effective)
        self._known.move_to_end(principal.workspace)
        while len(self._known) > KNOWN_POLICIES:
            self._known.popitem(last=False)
        return effective

    def lease_admission(self, principal: Principal, *, count: bool = True) -> tuple[Effective, LeaseAdmission] | None:
        """A CreateSession admitted by its lease's own round trip: the workspace's policy as this replica
        last read it, and the admission the lease script checks it against (None: not known here yet)."""
        known = self._known.get(principal.workspace)
        if known is None:
            return None
        admission = LeaseAdmission(jti=principal.jti, minute=int(time.time() // 60), count=count,
                                   rate_ceiling=self.codec.proxy_ceilings.get("requests_per_minute", 0),
                                   policy_digest=known.digest)
        return known.effective, admission

    def not_admitted(self, principal: Principal, refused: NotAdmitted) -> Effective:
        """A lease's admission that refused: its error (revoked, unreadable, over the rate); or, admitted
        under another policy than this replica knew, the values that policy puts in force (remembered)."""
        if refused.verdict == "revoked":
            raise self.refuse(AuthFailure("revoked", "the token has been revoked"))
        if refused.verdict == "unreadable":
            self._known.pop(principal.workspace, None)
            raise self._unreadable(principal)
        effective = self._decode(principal, refused.policy_raw)
        if refused.verdict == "rate":
            now = time.time()
            raise self._over_rate(effective.requests_per_minute, int(now // 60), now)
        return effective

    @staticmethod
    def _unreadable(principal: Principal) -> Unavailable:
        log.error("stored workspace policy is unreadable; refusing the workspace's requests",
                  extra={"workspace": principal.workspace})
        return Unavailable("the workspace's policy is unreadable; ask the operator", retry_after=60)

    @staticmethod
    def _over_rate(limit: int, minute: int, now: float) -> QuotaExceeded:
        retry_after = max(1, math.ceil((minute + 1) * 60 - now))
        return QuotaExceeded(f"the workspace's rate limit of {limit} requests per minute is exhausted",
                             retry_after=retry_after, limit="requests_per_minute")

    async def _untouch(self, principal: Principal, session_id: str, call: CallSpec) -> None:
        with contextlib.suppress(StateError):
            await self.stores.sessions.done(call_id=call.call_id, session_id=session_id, workspace=principal.workspace,
                                            now=time.time())

    async def not_revoked(self, principal: Principal) -> None:
        """The admin API's check: no rate counted, revocation still exact."""
        if principal.jti is None:
            return
        try:
            revoked = await self.stores.admission.is_revoked(principal.jti)
        except StateError as exc:
            raise self.store_failed(exc) from None
        if revoked:
            raise self.refuse(AuthFailure("revoked", "the token has been revoked"))
