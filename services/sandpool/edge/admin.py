"""The admin API: usage, workspace policy, live sessions, ending a session, token revocation.

A workspace token reads its own usage and sessions; everything else, and any
other workspace, needs an admin token (`scope` containing `admin`). Every route
checks revocation in Redis, so a revoked admin token stops at once. The router is
built with the app, so the policy model it takes is the limits catalogue's.
"""


import asyncio
import datetime as dt
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Path, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field, TypeAdapter, model_validator

from sandpool.contract import limits as catalogue
from sandpool.contract.models import ErrorBody, SessionDetails
from sandpool.contract.tenancy import WORKSPACE_PATTERN, is_valid_workspace
from sandpool.core.errors import Forbidden, Invalid, NotFound, Unavailable
from sandpool.edge.auth import MAX_JTI_CHARS, Principal
from sandpool.edge.edge import OPERATION_KEY
from sandpool.edge.gate import Gate
from sandpool.edge.policy import (
    above_ceilings,
    dump_policy,
    egress_outside,
    limit_values,
    list_values,
    load_policy,
    policy_model,
)
from sandpool.state import StateError
from sandpool.state.keys import USAGE_DAY_RETENTION_DAYS

log = logging.getLogger(__name__)

MAX_USAGE_DAYS = USAGE_DAY_RETENTION_DAYS
MAX_SESSIONS_LISTED = 10_000
MAX_REVOCATION_SECONDS = 10 * 365 * 86400
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"

WorkspaceName = Annotated[str, Path(pattern=WORKSPACE_PATTERN.pattern, description="Workspace name")]


class UsageDay(BaseModel):
    day: str = Field(description="UTC day, YYYY-MM-DD")
    counters: dict[str, Any] = Field(description="Counters of that day, shaped as `total` (absent: zero)")


class Usage(BaseModel):
    workspace: str
    total: dict[str, Any] = Field(description=(
        "Counters since the beginning, every one always present (0: nothing metered): sessions_created, "
        "session_seconds, executions, execution_seconds (totals), by_tool (executions and execution_seconds of "
        "every tool kind), bytes_uploaded and bytes_downloaded (file bytes), capacity_refusals, quota_refusals, "
        "egress_bytes, egress_bytes_in, egress_bytes_out, egress_connections, unconfirmed_executions"))
    days: list[UsageDay] = Field(default_factory=list, description="Per-day counters of the from..to range")


class EffectivePolicy(BaseModel):
    allowed_images: list[str] | None = Field(description="Images a CreateSession may name (null: any)")
    limits: dict[str, int] = Field(description="Values in force: the policy bounded by the ceilings (0: none)")
    egress_allow: list[str] = Field(default_factory=list, description=(
        "Destinations sessions leased from now on may reach through the egress proxy (empty: none); the "
        "egress proxy also bounds each connection by its ceiling"))


class SessionList(BaseModel):
    workspace: str
    sessions: list[SessionDetails]


class EndedSession(BaseModel):
    session_id: str
    workspace: str
    pool: str
    reason: str = Field(description="`admin`: ended through this API")
    session_seconds: float


class RevocationRequest(BaseModel):
    jti: str = Field(min_length=1, max_length=MAX_JTI_CHARS, description="The token's jti claim")
    exp: int | None = Field(default=None, ge=0, description="The token's exp claim (epoch seconds)")
    ttl: int | None = Field(default=None, ge=1, le=MAX_REVOCATION_SECONDS,
                            description="Or: keep the revocation this many seconds")

    @model_validator(mode="after")
    def _one_lifetime(self) -> "RevocationRequest":
        if (self.exp is None) == (self.ttl is None):
            raise ValueError("give exactly one of exp or ttl")
        return self


class Revocation(BaseModel):
    jti: str
    expires_at: float = Field(description="When the revocation is forgotten (the token would be expired)")


LIST_CHUNK = 100
"""Session handles a listing validates, or encodes, between two turns of the event loop."""
_DETAILS: TypeAdapter[SessionDetails] = TypeAdapter(SessionDetails)
_WORKSPACE: TypeAdapter[str] = TypeAdapter(str)


async def _session_details(workspace: str, sessions: list[dict[str, Any]]) -> list[SessionDetails]:
    """The handles as the declared model, validated before any byte is sent (a bad one is a 500 with its
    body, not a 200 cut short), `LIST_CHUNK` at a time with the event loop free between."""
    out: list[SessionDetails] = []
    for start in range(0, len(sessions), LIST_CHUNK):
        if start:
            await asyncio.sleep(0)
        out += [SessionDetails(workspace=workspace, **s) for s in sessions[start:start + LIST_CHUNK]]
    return out


async def _session_list_json(workspace: str, sessions: list[SessionDetails]) -> AsyncIterator[bytes]:
    """`SessionList(workspace, sessions)` as JSON, in pieces: what `model_dump_json` would write."""
    yield b'{"workspace":' + _WORKSPACE.dump_json(workspace) + b',"sessions":['
    for start in range(0, len(sessions), LIST_CHUNK):
        if start:
            await asyncio.sleep(0)  # sending a piece does not yield to the loop by itself (uvicorn writes at once)
        yield (b"," if start else b"") + b",".join(_DETAILS.dump_json(d) for d in sessions[start:start + LIST_CHUNK])
    yield b"]}"


def _gate(request: Request) -> Gate:
    return request.app.state.gate


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
    today = dt.datetime.now(dt.UTC).date()
    last = _day(end, "to") if end is not None else today
    first = _day(start, "from") if start is not None else last
    if first > last:
        raise Invalid("from is after to")
    count = (last - first).days + 1
    if count > MAX_USAGE_DAYS:
        raise Invalid(f"at most {MAX_USAGE_DAYS} days per request")
    return [(first + dt.timedelta(days=i)).isoformat() for i in range(count)]


ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "No valid bearer token (`cause` says why); WWW-Authenticate: Bearer"},
    403: {"model": ErrorBody, "description": "Another workspace's data, or an admin-only call, with a workspace token"},
    503: {"model": ErrorBody, "description": "Redis cannot be reached (`redis_unavailable`); retry after Retry-After"},
}


def build_router() -> APIRouter:
    """The `/v1` routes, with the policy model of the limits catalogue as it is now."""
    Policy = policy_model()  # a model class, named as one

    class PolicyView(BaseModel):
        workspace: str
        # Policy: a model class built at run time from the limits catalogue, which mypy cannot see
        policy: Policy = Field(description=(  # type: ignore[valid-type]  # see above
            "What is stored (null limits inherit the ceiling; a null egress_allow is empty: no egress)"))
        effective: EffectivePolicy
        ceilings: dict[str, int] = Field(description="The operator's ceilings, as enforced (0: none)")
        egress_ceiling: list[str] | None = Field(default=None, description=(
            "The egress proxy's ceiling, as it published it (null: no egress proxy has, so no egress)"))

    def view(workspace: str, policy: BaseModel, ceilings: dict[str, int],
             egress_ceiling: list[str] | None) -> PolicyView:
        images = policy.allowed_images  # type: ignore[attr-defined]  # a field of policy_model()
        return PolicyView(workspace=workspace, policy=policy, ceilings=ceilings, egress_ceiling=egress_ceiling,
                          effective=EffectivePolicy(
                              allowed_images=sorted(images) if images is not None else None,
                              limits=catalogue.combine_all(limit_values(policy), ceilings),
                              egress_allow=list_values(policy)["egress_allow"]))

    router = APIRouter(prefix="/v1", tags=["admin"], responses=ERRORS)

    @router.get("/usage", response_model=Usage, summary="A workspace's usage: totals and per-day counters")
    async def get_usage(request: Request, principal: Annotated[Principal, Depends(caller("get_usage"))],
                        workspace: Annotated[str | None, Query(description="Default: the token's workspace")] = None,
                        start: Annotated[str | None,
                                         Query(alias="from", description="First UTC day, YYYY-MM-DD")] = None,
                        end: Annotated[str | None,
                                       Query(alias="to", description="Last UTC day (default today)")] = None,
                        ) -> Usage:
        target = _workspace_for(principal, workspace)
        days = _days(start, end)
        gate = _gate(request)
        try:
            total, per_day = await gate.stores.usage.read(target, days)
        except StateError as exc:
            raise gate.store_failed(exc) from None
        return Usage(workspace=target, total=total, days=[UsageDay(**d) for d in per_day])

    @router.get("/sessions", response_model=SessionList, summary="A workspace's live sessions and their deadlines")
    async def list_sessions(request: Request, principal: Annotated[Principal, Depends(caller("list_sessions"))],
                            workspace: Annotated[str | None,
                                                 Query(description="Default: the token's workspace")] = None,
                            limit: Annotated[int, Query(ge=1, le=MAX_SESSIONS_LISTED)] = 1000) -> StreamingResponse:
        target = _workspace_for(principal, workspace)
        gate = _gate(request)
        try:
            sessions = await gate.stores.sessions.of_workspace(target, limit)
        except StateError as exc:
            raise gate.store_failed(exc) from None
        # Validated, then serialised, LIST_CHUNK handles at a time, the event loop free between chunks: through
        # `response_model` FastAPI validated the 1,000 handles of a full listing again and encoded them twice,
        # in one go, and every other call waited behind it (~60 ms: docs/capacity.md).
        details = await _session_details(target, sessions)
        return StreamingResponse(_session_list_json(target, details), media_type="application/json")

    @router.delete("/sessions/{session_id}", response_model=EndedSession,
                   summary="End any workspace's session (admin): the kill switch")
    async def end_session(request: Request,
                          session_id: Annotated[str, Path(pattern=SESSION_ID_PATTERN, description="Session id")],
                          principal: Annotated[Principal, Depends(caller("end_session"))]) -> EndedSession:
        _require_admin(principal)
        gate = _gate(request)
        try:
            released = await gate.stores.sessions.release(session_id=session_id, workspace=None, now=time.time(),
                                                           mode="admin")
        except StateError as exc:
            raise gate.store_failed(exc) from None
        if released is None:
            raise NotFound("no such session")
        log.info("session ended by an admin", extra={"admin": principal.subject, "workspace": released.workspace,
                                                     "session": session_id, "pool": released.pool})
        return EndedSession(session_id=session_id, workspace=released.workspace, pool=released.pool,
                            reason=released.reason, session_seconds=released.session_seconds)

    @router.get("/workspaces/{workspace}/policy", response_model=PolicyView, summary="A workspace's policy (admin)")
    async def get_policy(request: Request, workspace: WorkspaceName,
                         principal: Annotated[Principal, Depends(caller("get_policy"))]) -> PolicyView:
        _require_admin(principal)
        gate = _gate(request)
        try:
            raw = await gate.stores.admission.get_policy(workspace)
            egress_ceiling = await gate.stores.egress.ceiling()
        except StateError as exc:
            raise gate.store_failed(exc) from None
        try:
            policy = load_policy(raw)
        except ValueError:
            raise Unavailable("the stored policy is unreadable; PUT a new one", retry_after=60) from None
        return view(workspace, policy, gate.ceilings, egress_ceiling)

    @router.put("/workspaces/{workspace}/policy", response_model=PolicyView,
                summary="Replace a workspace's policy (admin); values above a ceiling are refused")
    async def put_policy(request: Request, workspace: WorkspaceName,
                         policy: Annotated[Policy, Body()],  # type: ignore[valid-type]  # see PolicyView
                         principal: Annotated[Principal, Depends(caller("put_policy"))]) -> PolicyView:
        _require_admin(principal)
        gate = _gate(request)
        try:
            egress_ceiling = await gate.stores.egress.ceiling()
        except StateError as exc:
            raise gate.store_failed(exc) from None
        violations = above_ceilings(policy, gate.ceilings)
        violations += egress_outside(list_values(policy)["egress_allow"], egress_ceiling)
        if violations:
            fields = list(dict.fromkeys(v.split("=")[0].split(":")[0] for v in violations))
            raise Invalid("; ".join(violations), fields=fields)
        try:
            await gate.stores.admission.put_policy(workspace, dump_policy(policy))
        except StateError as exc:
            raise gate.store_failed(exc) from None
        return view(workspace, policy, gate.ceilings, egress_ceiling)

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
            await gate.stores.admission.revoke(body.jti, ttl)
        except StateError as exc:
            raise gate.store_failed(exc) from None
        log.info("token revoked", extra={"admin": principal.subject, "jti": body.jti})
        return Revocation(jti=body.jti, expires_at=now + ttl)

    return router
