"""`Contract`: one contract operation served in process, edge and session layer, whoever calls it.

The HTTP routes and the MCP endpoint (`sandpool.mcp`) both call `handle`, so a tool
call is authenticated, admitted (tenancy, policy, rate, quotas, budgets) and metered
exactly as the contract call it stands for: there is one admission, not two. `asgi`
serves an operation from a request scope (errors become their JSON answer, the
response runs with its background `done`), which is how MCP calls it without HTTP.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from sandpool.api.settings import ApiSettings
from sandpool.core.asgi import OperationFastPath, client_gone, session_id_of
from sandpool.core.errors import SandpoolError, StateStoreUnavailable, error_response
from sandpool.core.responses import ModelResponse
from sandpool.edge.auth import Principal
from sandpool.edge.edge import OPERATION_KEY
from sandpool.edge.gate import Gate
from sandpool.edge.images import check_image
from sandpool.edge.policy import Effective
from sandpool.sessions.caller import STANDALONE, Admitted, Caller
from sandpool.sessions.limits import WorkspacePolicy
from sandpool.sessions.metrics import ApiMetrics
from sandpool.sessions.service import SESSION_ID_PATTERN, SessionLayer, read_capped
from sandpool.state import StateUnavailable
from sandpool.state.sessions import LeaseAdmission, NotAdmitted

log = logging.getLogger(__name__)

CREATE_BODY_CAP = 64 * 1024
"""A CreateSession body carries three hints; anything near this size is not one."""
UNCOUNTED = frozenset({"DestroySession", "CancelExecution"})
"""Operations that free resources: never refused for the rate, never counted against it."""
CALLS = frozenset({"Execute", "ListFiles", "GetFile", "PutFile", "CancelExecution"})
"""Calls to a session's agent: admitted, their session touched and the call recorded in one round trip."""


# --- the operations, over the session layer --------------------------------------------------

async def _create_session(request: Request, sessions: SessionLayer, caller: Caller, body: bytes,
                          admission: LeaseAdmission | None = None) -> Response:
    handle = await sessions.create_session(caller, body, client_gone=lambda: client_gone(request),
                                           admission=admission)
    return ModelResponse(handle, status_code=201, exclude_unset=True, background=sessions.answered(handle.session_id))


async def _create_admitted(request: Request, sessions: SessionLayer, gate: Gate, principal: Principal,
                           body: bytes) -> Response:
    """CreateSession with auth on. Where this replica knows the workspace's policy, the lease's own round
    trip admits it (revocation, rate, and that policy still in force); where it does not, or the policy
    changed meanwhile, the edge reads it (a second round trip) and the lease runs under it."""
    known = gate.lease_admission(principal)
    if known is not None:
        effective, admission = known
        try:
            check_image(body, effective)
        except SandpoolError:
            known = None  # (refused under the policy this replica knew: the one in force decides)
        else:
            try:
                return await _create_session(request, sessions, _caller(principal, effective), body,
                                             admission=admission)
            except NotAdmitted as refused:
                # Admitted (and counted) under another policy than the one known here: lease under it.
                effective = gate.not_admitted(principal, refused)
                check_image(body, effective)
                again = gate.lease_admission(principal, count=False)
                assert again is not None
                return await _create_session(request, sessions, _caller(principal, effective), body,
                                             admission=again[1])
    effective = await gate.admit(principal)
    check_image(body, effective)
    return await _create_session(request, sessions, _caller(principal, effective), body)


def _caller(principal: Principal, effective: Effective) -> Caller:
    return Caller.of(principal.workspace, effective.limits, effective.egress_allow)


async def _get_session(request: Request, sessions: SessionLayer, caller: Caller) -> Response:
    return ModelResponse(await sessions.get_session(caller, session_id_of(request)), exclude_unset=True)


async def _destroy_session(request: Request, sessions: SessionLayer, caller: Caller) -> Response:
    await sessions.destroy_session(caller, session_id_of(request))
    return Response(status_code=204)


async def _execute(request: Request, sessions: SessionLayer, caller: Caller) -> Response:
    return await sessions.execute(caller, session_id_of(request), request)


async def _list_files(request: Request, sessions: SessionLayer, caller: Caller) -> Response:
    return await sessions.list_files(caller, session_id_of(request), request)


async def _get_file(request: Request, sessions: SessionLayer, caller: Caller) -> Response:
    return await sessions.get_file(caller, session_id_of(request), request)


async def _put_file(request: Request, sessions: SessionLayer, caller: Caller) -> Response:
    return await sessions.put_file(caller, session_id_of(request), request)


async def _cancel_exec(request: Request, sessions: SessionLayer, caller: Caller) -> Response:
    return await sessions.cancel_exec(caller, session_id_of(request), request)


OPERATIONS = {
    "GetSession": _get_session, "DestroySession": _destroy_session, "Execute": _execute,
    "ListFiles": _list_files, "GetFile": _get_file, "PutFile": _put_file, "CancelExecution": _cancel_exec,
}
"""Every operation but CreateSession (whose body the edge reads first) by name."""


class Contract:
    """The contract's operations for one api app: `handle(request, operation)` reads the session layer
    and the edge's gate (None: `--no-auth`) from `request.app.state`, as the lifespan set them."""

    def __init__(self, settings: ApiSettings, metrics: ApiMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.create_cap = min(CREATE_BODY_CAP, settings.max_body_bytes)
        self.asgi = OperationFastPath(_not_an_operation, self.handle, self.errors)
        """Serves the operation a scope's method and path name (`sandpool.mcp` builds such scopes)."""

    async def handle(self, request: Request, operation: str) -> Response:
        request.scope[OPERATION_KEY] = operation
        sessions: SessionLayer = request.app.state.sessions
        gate: Gate | None = request.app.state.gate
        if gate is None:
            if operation == "CreateSession":
                return await _create_session(request, sessions, STANDALONE,
                                             await read_capped(request, self.create_cap))
            return await OPERATIONS[operation](request, sessions, STANDALONE)
        principal = await gate.principal(request)
        if operation == "CreateSession":
            return await _create_admitted(request, sessions, gate, principal,
                                          await read_capped(request, self.create_cap))
        count = operation not in UNCOUNTED
        session_id = session_id_of(request) if operation in CALLS else ""
        if SESSION_ID_PATTERN.fullmatch(session_id):
            # An Execute's body is read and checked first, so its record names its tool.
            exec_body = (sessions.exec_body(await read_capped(request, self.settings.max_body_bytes))
                         if operation == "Execute" else None)
            call = sessions.call_spec(exec_body)
            effective, target = await gate.admit_call(principal, session_id, call=call, count=count)
            caller = Caller(workspace=principal.workspace, policy=WorkspacePolicy(effective.limits),
                            egress_allow=effective.egress_allow, admitted=Admitted(call, target, exec_body))
        else:
            effective = await gate.admit(principal, count=count)
            caller = Caller.of(principal.workspace, effective.limits, effective.egress_allow)
        return await OPERATIONS[operation](request, sessions, caller)

    async def authenticate(self, request: Request, operation: str) -> tuple[str, str | None]:
        """A request served under the contract's authentication that is no contract operation (`/mcp`): the
        workspace it is made for and its credential, as the gate checks them (signature, claims, revocation;
        401 with `WWW-Authenticate: Bearer` without a valid token); standalone, the one trusted client.
        `operation` names it in the edge's metrics."""
        request.scope[OPERATION_KEY] = operation
        gate: Gate | None = request.app.state.gate
        if gate is None:
            return STANDALONE.workspace, None
        principal = await gate.principal(request)
        await gate.not_revoked(principal)
        return principal.workspace, request.headers.get("authorization")

    def errors(self, exc: Exception) -> Response | None:
        """A Redis failure's answer (503, counted and logged); None for any other exception."""
        if not isinstance(exc, StateUnavailable):
            return None
        self.metrics.redis_error()
        cause = exc.__cause__ or exc
        log.warning("redis call failed", extra={"error": f"{type(cause).__name__}: {exc}"})
        return error_response(StateStoreUnavailable("state store unavailable; retry later", retry_after=1))


async def _not_an_operation(scope: Scope, receive: Receive, send: Send) -> None:
    await Response(status_code=404)(scope, receive, send)


__all__ = ["CALLS", "CREATE_BODY_CAP", "Contract", "UNCOUNTED"]
