"""The admin API: usage, workspace policy, live sessions, token revocation.

A workspace token reads its own usage and sessions; everything else, and any
other workspace, needs an admin token (`scope` containing `admin`). Every
route checks revocation in Redis, so a revoked admin token stops at once.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from typing import Annotated, Any

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, Field, model_validator

from sandpool.contract.models import ErrorBody
from sandpool.contract.tenancy import WORKSPACE_PATTERN, is_valid_workspace
from sandpool.core.errors import Forbidden, Invalid, Unavailable
from sandpool.proxy.auth import MAX_JTI_CHARS, Principal
from sandpool.proxy.edge import OPERATION_KEY
from sandpool.proxy.gate import Gate
from sandpool.proxy.policy import Policy, above_ceilings, dump_policy, effective, load_policy
from sandpool.proxy.store import StoreError
from sandpool.state.keys import USAGE_DAY_RETENTION_DAYS

MAX_USAGE_DAYS = USAGE_DAY_RETENTION_DAYS
MAX_SESSIONS_LISTED = 10_000
MAX_REVOCATION_SECONDS = 10 * 365 * 86400

WorkspaceName = Annotated[str, Path(pattern=WORKSPACE_PATTERN.pattern, description="Workspace name")]


class UsageDay(BaseModel):
    day: str = Field(description="UTC day, YYYY-MM-DD")
    counters: dict[str, int | float] = Field(description="Counters of that day (absent: zero)")


class Usage(BaseModel):
    workspace: str
    total: dict[str, int | float] = Field(description="Counters since the beginning (names in state/usage.py)")
    days: list[UsageDay] = Field(default_factory=list, description="Per-day counters of the from..to range")


class EffectivePolicy(BaseModel):
    allowed_images: list[str] | None = Field(description="Images a CreateSession may name (null: any)")
    limits: dict[str, int] = Field(description="Values in force: the policy bounded by the ceilings (0: none)")


class PolicyView(BaseModel):
    workspace: str
    policy: Policy = Field(description="What is stored (null fields inherit the ceiling)")
    effective: EffectivePolicy
    ceilings: dict[str, int] = Field(description="The operator's ceilings (0: no ceiling at the proxy)")


class SessionInfo(BaseModel):
    session_id: str
    pool: str | None = None
    image: str | None = None
    created_at: float | None = None
    last_activity_at: float | None = None
    idle_timeout_seconds: int | float | None = None
    max_lifetime_seconds: int | float | None = None
    exec_timeout_seconds: int | float | None = None
    deadline: float | None = Field(default=None, description="When the reaper ends it (epoch seconds)")


class SessionList(BaseModel):
    workspace: str
    sessions: list[SessionInfo]


class RevocationRequest(BaseModel):
    jti: str = Field(min_length=1, max_length=MAX_JTI_CHARS, description="The token's jti claim")
    exp: int | None = Field(default=None, ge=0, description="The token's exp claim (epoch seconds)")
    ttl: int | None = Field(default=None, ge=1, le=MAX_REVOCATION_SECONDS,
                            description="Or: keep the revocation this many seconds")

    @model_validator(mode="after")
    def _one_lifetime(self) -> RevocationRequest:
        if (self.exp is None) == (self.ttl is None):
            raise ValueError("give exactly one of exp or ttl")
        return self


class Revocation(BaseModel):
    jti: str
    expires_at: float = Field(description="When the revocation is forgotten (the token would be expired)")


def _gate(request: Request) -> Gate:
    return request.app.state.gate  # type: ignore[no-any-return]


def caller(operation: str) -> Callable[[Request], Awaitable[Principal]]:
    """A dependency authenticating the caller. FastAPI runs it before it reports parameter or body
    validation errors, so an unauthenticated request learns nothing but 401."""

    async def dependency(request: Request) -> Principal:
        request.scope[OPERATION_KEY] = operation
        gate = _gate(request)
        principal = await gate.principal(request)
        await gate.not_revoked(principal)
        return principal

    return dependency


def _workspace_for(principal: Principal, workspace: str | None) -> str:
    target = principal.workspace if workspace is None else workspace
    if not is_valid_workspace(target):
        raise Invalid("workspace is not a valid workspace name")
    if target != principal.workspace and not principal.is_admin:
        raise Forbidden("a workspace token may only read its own workspace")
    return target


def _require_admin(principal: Principal) -> None:
    if not principal.is_admin:
        raise Forbidden("this operation needs an admin token")


def _day(value: str, name: str) -> dt.date:
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise Invalid(f"{name} must be a date, YYYY-MM-DD") from None


def _days(start: str | None, end: str | None) -> list[str]:
    if start is None and end is None:
        return []
    today = dt.datetime.now(dt.timezone.utc).date()
    last = _day(end, "to") if end is not None else today
    first = _day(start, "from") if start is not None else last
    if first > last:
        raise Invalid("from is after to")
    count = (last - first).days + 1
    if count > MAX_USAGE_DAYS:
        raise Invalid(f"at most {MAX_USAGE_DAYS} days per request")
    return [(first + dt.timedelta(days=i)).isoformat() for i in range(count)]


def _store_call_failed(request: Request, exc: StoreError) -> Unavailable:
    return _gate(request).store_failed(exc)


def _view(workspace: str, policy: Policy, ceilings: dict[str, int]) -> PolicyView:
    eff = effective(policy, ceilings)
    return PolicyView(workspace=workspace, policy=policy, ceilings=ceilings,
                      effective=EffectivePolicy(
                          allowed_images=sorted(eff.allowed_images) if eff.allowed_images is not None else None,
                          limits=eff.limits))


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "No valid bearer token (`cause` says why); WWW-Authenticate: Bearer"},
    403: {"model": ErrorBody, "description": "Another workspace's data, or an admin-only call, with a workspace token"},
    503: {"model": ErrorBody, "description": "Redis cannot be reached (`redis_unavailable`); retry after Retry-After"},
}

router = APIRouter(prefix="/v1", tags=["admin"], responses=ERRORS)


@router.get("/usage", response_model=Usage, summary="A workspace's usage: totals and per-day counters")
async def get_usage(request: Request, principal: Annotated[Principal, Depends(caller("get_usage"))],
                    workspace: Annotated[str | None, Query(description="Default: the token's workspace")] = None,
                    start: Annotated[str | None, Query(alias="from", description="First UTC day, YYYY-MM-DD")] = None,
                    end: Annotated[str | None, Query(alias="to", description="Last UTC day (default today)")] = None,
                    ) -> Usage:
    target = _workspace_for(principal, workspace)
    days = _days(start, end)
    try:
        total, per_day = await _gate(request).store.usage(target, days)
    except StoreError as exc:
        raise _store_call_failed(request, exc) from None
    return Usage(workspace=target, total=total, days=[UsageDay(**d) for d in per_day])


@router.get("/sessions", response_model=SessionList, summary="A workspace's live sessions and their deadlines")
async def list_sessions(request: Request, principal: Annotated[Principal, Depends(caller("list_sessions"))],
                        workspace: Annotated[str | None, Query(description="Default: the token's workspace")] = None,
                        limit: Annotated[int, Query(ge=1, le=MAX_SESSIONS_LISTED)] = 1000) -> SessionList:
    target = _workspace_for(principal, workspace)
    try:
        sessions = await _gate(request).store.sessions(target, limit)
    except StoreError as exc:
        raise _store_call_failed(request, exc) from None
    return SessionList(workspace=target, sessions=[SessionInfo(**s) for s in sessions])


@router.get("/workspaces/{workspace}/policy", response_model=PolicyView, summary="A workspace's policy (admin)")
async def get_policy(request: Request, workspace: WorkspaceName,
                     principal: Annotated[Principal, Depends(caller("get_policy"))]) -> PolicyView:
    _require_admin(principal)
    gate = _gate(request)
    try:
        raw = await gate.store.get_policy(workspace)
    except StoreError as exc:
        raise _store_call_failed(request, exc) from None
    try:
        policy = load_policy(raw)
    except ValueError:
        raise Unavailable("the stored policy is unreadable; PUT a new one", retry_after=60) from None
    return _view(workspace, policy, gate.codec.ceilings)


@router.put("/workspaces/{workspace}/policy", response_model=PolicyView,
            summary="Replace a workspace's policy (admin); values above a ceiling are refused")
async def put_policy(request: Request, workspace: WorkspaceName, policy: Policy,
                     principal: Annotated[Principal, Depends(caller("put_policy"))]) -> PolicyView:
    _require_admin(principal)
    gate = _gate(request)
    violations = above_ceilings(policy, gate.codec.ceilings)
    if violations:
        raise Invalid("; ".join(violations), fields=[v.split("=")[0] for v in violations])
    try:
        await gate.store.put_policy(workspace, dump_policy(policy))
    except StoreError as exc:
        raise _store_call_failed(request, exc) from None
    return _view(workspace, policy, gate.codec.ceilings)


@router.post("/revocations", response_model=Revocation, status_code=201,
             summary="Revoke a token by jti (admin), until the token would have expired")
async def revoke(request: Request, body: RevocationRequest,
                 principal: Annotated[Principal, Depends(caller("revoke"))]) -> Revocation:
    _require_admin(principal)
    gate = _gate(request)
    now = time.time()
    if body.ttl is not None:
        ttl = body.ttl
    else:
        assert body.exp is not None
        # Kept past exp by the leeway, during which the verifier would still accept the token.
        ttl = min(MAX_REVOCATION_SECONDS, math.ceil(body.exp - now) + gate.verifier.leeway)
    ttl = max(1, ttl)
    try:
        await gate.store.revoke(body.jti, ttl)
    except StoreError as exc:
        raise _store_call_failed(request, exc) from None
    return Revocation(jti=body.jti, expires_at=now + ttl)

