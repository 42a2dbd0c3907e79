"""The six contract operations: leases from Redis, calls forwarded to the session's agent.

Per call the session layer does one script round trip before forwarding (resolve
and touch the session, record the call: with auth on, the edge's admission does
it) and one after the answer is sent (the call's `done`: `sessions.calls`); a
lease is a single round trip. Bodies pass through byte for byte: only an exec's
`timeout_seconds` is rewritten, and only when it must be clamped or filled in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sandpool.contract.agent_protocol import FENCED_STATUS, Outcome
from sandpool.contract.models import (
    CreateSessionRequest,
    SessionDetails,
    UnknownTool,
    parse_exec_request,
)
from sandpool.contract.reasons import Reason
from sandpool.core import tracing
from sandpool.core.errors import (
    AtCapacity,
    BadGateway,
    Invalid,
    NotFound,
    PayloadTooLarge,
    QuotaExceeded,
    SandpoolError,
    Unavailable,
    UnknownToolKind,
)
from sandpool.core.hop import HopBusy, HopConnectError, HopError
from sandpool.core.hop import Response as HopResponse
from sandpool.core.logs import request_id_var
from sandpool.core.request_ids import ACCESS_EXTRA_KEY
from sandpool.sessions import limits
from sandpool.sessions.answers import Answers
from sandpool.sessions.caller import Caller, ExecBody
from sandpool.sessions.calls import NOTHING, Call, Metered, new_call_id
from sandpool.sessions.forward import (
    CALL_ID,
    FENCED,
    OUTCOME_HEADER,
    AgentClients,
    BadAddress,
    ClientSlot,
    request_headers,
    response_headers,
)
from sandpool.sessions.metrics import EXEC_OUTCOMES, ApiMetrics
from sandpool.sessions.pools import PoolDirectory
from sandpool.sessions.settings import SessionSettings
from sandpool.sessions.stream import (
    EVENT_STREAM,
    EventStreamResponse,
    StreamRelay,
    cancel_on_disconnect,
    wants_stream,
)
from sandpool.sessions.uploads import FileBytes
from sandpool.sessions.waiting import Waiters
from sandpool.state import usage
from sandpool.state.errors import StateUnavailable
from sandpool.state.sessions import CallSpec, LeaseAdmission, Leased, Refused, SessionStore, Target, Waiting

log = logging.getLogger(__name__)

SESSION_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
UNKNOWN_SESSION = "session not found"
SMALL_ANSWER_BYTES = 256 * 1024
"""Agent answers up to this size (with a Content-Length) are relayed whole; larger ones stream."""
ABANDON_RETRY_SECONDS = 60.0
"""How long an abandoned lease's release is retried; past it, the session's idle timeout reaps it."""
MAX_RETRY_AFTER_SECONDS = 60
"""The longest Retry-After a capacity refusal estimates."""
PAST_CEILING_MIN_WAIT_SECONDS = 1.0
"""The shortest wait of a caller queued at a full pool (its releases may be due in milliseconds, and
its sandbox still has to start)."""


class SandboxUnavailable(Unavailable):
    """The session's agent could not be reached: the call did not run, the session is gone."""

    reason = Reason.SANDBOX_UNAVAILABLE


class StartTimeout(Unavailable):
    """Below the ceiling, but no sandbox could be started within the capacity wait."""

    reason = Reason.START_TIMEOUT


class ClientLeft(SandpoolError):
    """The caller disconnected while waiting; nobody reads this answer (nginx's 499)."""

    status_code = 499
    reason = Reason.CLIENT_CLOSED_REQUEST


class SessionEnded(BadGateway):
    """The session was released while a call to it ran (destroyed, ended by an admin, reaped, or its
    sandbox was lost): the call is cut short rather than left to hang on a sandbox that is going."""

    reason = Reason.SESSION_ENDED


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (rather than something it awaits)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def retry_after(refused: Refused) -> int:
    """When a slot may be free, from the pool's release rate: its waiters and this caller each need one
    release (a pool that released nothing in the last minute: a minute)."""
    per_second = refused.releases_per_minute / 60.0
    if per_second <= 0:
        return MAX_RETRY_AFTER_SECONDS
    return max(1, min(MAX_RETRY_AFTER_SECONDS, math.ceil((refused.waiters + 1) / per_second)))


def patience(waiting: Waiting, wait: float) -> float:
    """How long a queued caller waits. Below the ceiling, the whole capacity wait for the start made
    for it. Past it, twice the time its releases are expected to take at the pool's recent rate (the
    lease script queued it only if that fits in the wait): long enough for the pool's pace, and a
    pool whose sessions stop ending answers `at_capacity` soon rather than at the end of the wait."""
    if not waiting.past_ceiling:
        return wait
    return min(wait, max(PAST_CEILING_MIN_WAIT_SECONDS, 2 * waiting.expected_seconds()))


def new_session_id() -> str:
    """128 random bits (a session id is a capability within its workspace), never beginning with '-':
    a command line would read such an id as an option (`sandpool admin end-session <id>` refused one
    id in 64). Drawn again rather than changed, so every allowed id stays equally likely."""
    while (session_id := secrets.token_urlsafe(16)).startswith("-"):
        pass
    return session_id


def unknown_session() -> NotFound:
    """The one answer for an unknown id and for another workspace's session alike."""
    return NotFound(UNKNOWN_SESSION)


def _validation_error(exc: ValidationError) -> RequestValidationError:
    return RequestValidationError(exc.errors(include_input=False, include_url=False))


class _TooLarge(Exception):
    pass


async def read_capped(request: Request, cap: int) -> bytes:
    """The whole request body, refusing (413) past `cap` without buffering more than that."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise PayloadTooLarge(f"request body over the {cap}-byte cap")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise PayloadTooLarge(f"request body over the {cap}-byte cap")
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class _Counter:
    n: int = 0


class SessionLayer:
    def __init__(self, settings: SessionSettings, store: SessionStore, clients: AgentClients,
                 metrics: ApiMetrics, pools: PoolDirectory, waiters: Waiters | None = None) -> None:
        self.settings = settings
        self.store = store
        self.clients = clients
        self.metrics = metrics
        self.pools = pools
        self.waiters = waiters
        self.ceilings = limits.Ceilings.from_settings(settings)
        self.answers = Answers(store, settings.answer_grace_seconds)
        self._background: set[asyncio.Task[Any]] = set()
        self._abandons: set[asyncio.Task[Any]] = set()  # retries that may outlast Redis: not awaited at exit
        self._in_flight: dict[str, set[asyncio.Future[Any]]] = {}  # session id -> its calls to the agent
        self._streams: set[asyncio.Future[Any]] = set()  # streamed calls' pumps (they outlive their request)

    # --- CreateSession ------------------------------------------------------------------------

    async def create_session(self, caller: Caller, body: bytes, *,
                             client_gone: Callable[[], Awaitable[None]] | None = None,
                             admission: LeaseAdmission | None = None) -> SessionDetails:
        """Lease a sandbox; with none ready, wait (up to the capacity wait) while the controller starts
        one: below the ceiling at once, at it once a release frees a slot (only when the pool's recent
        releases say one comes in time: else 503 at once). `client_gone` returns when the caller
        disconnects: it stops waiting. `admission`: the edge's admission, run by the lease's own round
        trip (`NotAdmitted` when it refuses)."""
        hints = self._parse_create(body)
        pool = self.pools.for_image(hints.image)
        policy = limits.in_force(self.ceilings, caller.policy)
        in_force = limits.session_limits(self.ceilings, policy, idle_hint=hints.idle_timeout_seconds,
                                         lifetime_hint=hints.max_lifetime_seconds)
        session_id = new_session_id()
        wait = self.settings.capacity_wait_seconds if self.waiters is not None else 0.0
        now = time.time()
        try:
            result = await self.store.lease(
                session_id=session_id, workspace=caller.workspace, pool=pool.name, image=pool.image, now=now,
                limits=in_force, workspace_limits=limits.lease_limits(self.ceilings, caller.policy),
                ceiling=pool.ceiling, wait_seconds=wait, egress_allow=caller.egress_allow, admission=admission,
                answer_grace=self.settings.answer_grace_seconds)
            if isinstance(result, Waiting):
                result = await self._wait_for_sandbox(caller, session_id, pool.name, patience(result, wait),
                                                      client_gone, past_ceiling=result.past_ceiling)
                now = time.time()
        except StateUnavailable:
            # The lease (or a waiter's claim) may already be on its way and run once a slow Redis
            # catches up: a session nobody was answered for. Release that id as soon as Redis
            # answers again.
            self._spawn(self._abandon(caller, session_id, pool.name), cancel_on_drain=True)
            raise
        if isinstance(result, Refused):
            raise self._refusal(result, pool.name, now)
        self.metrics.leases.labels(outcome="granted").inc()
        log.info("session created", extra={"session": session_id, "workspace": caller.workspace,
                                           "pool": pool.name, "sandbox": result.sandbox})
        return SessionDetails(
            session_id=session_id, idle_timeout_seconds=in_force.idle_timeout_seconds,
            max_lifetime_seconds=in_force.max_lifetime_seconds, created_at=now, last_activity_at=now,
            image=pool.image, pool=pool.name, exec_timeout_seconds=in_force.exec_timeout_seconds,
            max_exec_timeout_seconds=in_force.max_exec_timeout_seconds)

    def answered(self, session_id: str) -> BackgroundTask | None:
        """What a CreateSession's response runs once it is sent: the session is confirmed (until then it
        is due at the answer's grace: `sessions.answers`, whose `run` the app runs). None with no grace."""
        if not self.settings.answer_grace_seconds:
            return None
        return BackgroundTask(self.answers.answered, session_id)

    def _refusal(self, refused: Refused, pool: str, now: float) -> SandpoolError:
        if refused.kind == "quota":
            self.metrics.leases.labels(outcome="quota").inc()
            retry = (limits.seconds_until_utc_midnight(now) if refused.limit == "daily_session_seconds_budget"
                     else self.settings.retry_after_seconds)
            return QuotaExceeded(f"the workspace's {refused.limit.replace('_', ' ')} limit is reached",
                                 retry_after=retry, limit=refused.limit)
        self.metrics.leases.labels(outcome="capacity").inc()
        return AtCapacity("every sandbox of the pool is in use or promised to an earlier caller; retry later",
                          retry_after=retry_after(refused), pool=pool)

    async def _wait_for_sandbox(self, caller: Caller, session_id: str, pool: str, wait: float,
                                client_gone: Callable[[], Awaitable[None]] | None, *,
                                past_ceiling: bool = False) -> Leased:
        """Wait, queued in Redis, until a sandbox is promised to this caller, then claim it.
        `past_ceiling`: queued at a full pool, for a slot a release frees (not only for a start)."""
        assert self.waiters is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        promised = self.waiters.register(session_id)
        gone = asyncio.ensure_future(client_gone()) if client_gone is not None else None
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining > 0:
                    woken = asyncio.ensure_future(promised.wait())
                    done, _ = await asyncio.wait({woken, *([gone] if gone else [])}, timeout=remaining,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    woken.cancel()
                    if gone is not None and gone in done:
                        raise ClientLeft("the client left while waiting for a sandbox")
                promised.clear()
                claimed = await self.store.claim(waiter=session_id, workspace=caller.workspace, pool=pool,
                                                 now=time.time())
                if isinstance(claimed, Leased):
                    return claimed
                if claimed is None or loop.time() >= deadline:
                    break
        except BaseException:
            # The caller left (or this task was cancelled): hand on whatever was promised to it.
            self._spawn(self.store.cancel_wait(waiter=session_id, workspace=caller.workspace, pool=pool,
                                               now=time.time()))
            raise
        finally:
            self.waiters.forget(session_id)
            if gone is not None:
                gone.cancel()
        if past_ceiling:  # no release freed a slot in time (the pool's release rate fell meanwhile)
            await self.store.cancel_wait(waiter=session_id, workspace=caller.workspace, pool=pool,
                                         now=time.time(), refusal="at_capacity")
            self.metrics.leases.labels(outcome="capacity").inc()
            raise AtCapacity(f"no sandbox of the pool was released for this caller within {wait:.3g}s; "
                             "retry later", retry_after=self.settings.retry_after_seconds, pool=pool)
        await self.store.cancel_wait(waiter=session_id, workspace=caller.workspace, pool=pool, now=time.time(),
                                     refusal="start_timeout")
        self.metrics.leases.labels(outcome="start_timeout").inc()
        cause = await self.store.last_error(pool)
        log.warning("no sandbox could be started in time", extra={"pool": pool, "wait_seconds": wait,
                                                                  "provider_error": cause or None})
        raise StartTimeout(f"no sandbox could be started within {wait:g}s; retry later",
                           retry_after=self.settings.retry_after_seconds, pool=pool)

    @staticmethod
    def _parse_create(body: bytes) -> CreateSessionRequest:
        if not body.strip():
            return CreateSessionRequest()
        try:
            return CreateSessionRequest.model_validate_json(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    # --- GetSession (sandpool's addition) ------------------------------------------------------

    async def get_session(self, caller: Caller, session_id: str) -> SessionDetails:
        """The session's handle: what is in force, its times and reaping deadline. Not activity."""
        if not SESSION_ID_PATTERN.fullmatch(session_id):
            raise unknown_session()
        handle = await self.store.handle(session_id, workspace=caller.workspace)
        if handle is None:
            raise unknown_session()
        return SessionDetails.model_validate(handle)

    # --- DestroySession ---------------------------------------------------------------------

    async def destroy_session(self, caller: Caller, session_id: str) -> None:
        if not SESSION_ID_PATTERN.fullmatch(session_id):
            return
        released = await self.store.release(session_id=session_id, workspace=caller.workspace,
                                            now=time.time(), mode="destroy")
        if released is not None:
            self.answers.called(session_id)  # (nothing left to confirm)
            self.clients.forget(released.address)
            log.info("session destroyed", extra={"session": session_id, "session_seconds": released.session_seconds})

    # --- Execute ------------------------------------------------------------------------------

    def exec_body(self, raw: bytes) -> ExecBody:
        """An Execute's body parsed and checked (400, 422 for a bad one), before its call is admitted."""
        doc, parsed = self._parse_exec(raw)
        # The longest timeout it may run with, known before the session and the workspace's policy are read.
        bound = limits.exec_timeout(parsed.timeout_seconds, default=self.ceilings.default_exec,
                                    ceiling=self.ceilings.max_exec, workspace_max=0) or self.ceilings.max_exec
        return ExecBody(raw=raw, doc=doc, tool=parsed.tool, timeout_hint=parsed.timeout_seconds, bound=bound)

    def call_spec(self, body: ExecBody | None = None) -> CallSpec:
        """A new call's record: an Execute keeps its session busy over its longest run and grace, a
        file call over the forwarding timeout."""
        grace = self.settings.call_record_grace_seconds
        if body is not None:
            return CallSpec(new_call_id(), busy_for=body.bound + self.settings.exec_grace_seconds, tool=body.tool,
                            grace=grace)
        return CallSpec(new_call_id(), busy_for=self.settings.forward_timeout_seconds, grace=grace)

    async def execute(self, caller: Caller, session_id: str, request: Request) -> Response:
        if not SESSION_ID_PATTERN.fullmatch(session_id):
            raise unknown_session()
        if caller.admitted is not None:
            body = caller.admitted.body
            assert body is not None, "the edge admits an Execute with its body read"
        else:
            body = self.exec_body(await read_capped(request, self.settings.max_body_bytes))
        call, target = await self._admitted(caller, session_id, body)
        tool = body.tool
        # The access line names the call's tool, and its outcome once known before the answer starts (a
        # streamed call's comes after): what the agent's own line added, which it writes only at info.
        access = request.scope[ACCESS_EXTRA_KEY] = {"tool": tool}
        # (The model already refused a non-integer; the fallback only keeps the type honest.)
        timeout = limits.exec_timeout(body.timeout_hint, default=target.exec_timeout_seconds,
                                      ceiling=target.max_exec_timeout_seconds,
                                      workspace_max=caller.policy.get("max_exec_timeout_seconds", 0)
                                      ) or min(target.exec_timeout_seconds, target.max_exec_timeout_seconds)
        content = body.raw
        if body.doc.get("timeout_seconds") != timeout or isinstance(body.doc.get("timeout_seconds"), bool):
            content = json.dumps({**body.doc, "timeout_seconds": timeout}, separators=(",", ":"),
                                 ensure_ascii=False).encode()

        async def metered(status: int, outcome: str, elapsed: float, _: int) -> Metered:
            if status == 200:
                access["outcome"] = outcome
            if status != 200 or outcome == Outcome.WITHDRAWN:  # a withdrawn call never ran
                return NOTHING
            self.metrics.executions.labels(tool=tool, outcome=outcome).inc()
            self.metrics.execution_duration.labels(tool=tool).observe(elapsed)
            return Metered("execution", {usage.EXECUTIONS: 1, usage.EXECUTION_SECONDS: elapsed}, tool=tool)

        return await self._forward(
            call, target, request, "POST", f"/sessions/{session_id}/exec",
            content=content, read_timeout=timeout + self.settings.exec_grace_seconds, meter=metered,
            stream=wants_stream(request.headers.raw), name_call=True,
        )

    async def cancel_exec(self, caller: Caller, session_id: str, request: Request) -> Response:
        """CancelExecution (sandpool's addition): stop the session's running call. Sent to the agent on
        a connection of its own, so it never waits behind the call it stops; the agent answers 204
        once the call was stopped, 409 `no_running_call` when none runs."""
        call, target = await self._file_call(caller, session_id)
        return await self._forward(call, target, request, "DELETE", f"/sessions/{session_id}/exec",
                                   read_timeout=self.settings.forward_timeout_seconds)

    @staticmethod
    def _parse_exec(body: bytes) -> tuple[dict[str, Any], Any]:
        try:
            doc = json.loads(body)
        except ValueError:
            raise Invalid("the body is not valid JSON") from None
        if not isinstance(doc, dict):
            raise Invalid("the body must be a JSON object")
        try:
            parsed = parse_exec_request(doc)
        except UnknownTool as exc:
            raise UnknownToolKind(str(exc)) from None
        except ValidationError as exc:
            raise _validation_error(exc) from None
        return doc, parsed

    # --- files --------------------------------------------------------------------------------

    async def list_files(self, caller: Caller, session_id: str, request: Request) -> Response:
        call, target = await self._file_call(caller, session_id)
        return await self._forward(call, target, request, "GET", f"/sessions/{session_id}/files/list",
                                   read_timeout=self.settings.forward_timeout_seconds)

    async def get_file(self, caller: Caller, session_id: str, request: Request) -> Response:
        call, target = await self._file_call(caller, session_id)

        async def metered(status: int, _o: str, _e: float, moved: int) -> Metered:
            return Metered("download", {usage.BYTES_DOWNLOADED: moved}) if status == 200 else NOTHING

        return await self._forward(call, target, request, "GET", f"/sessions/{session_id}/files",
                                   read_timeout=self.settings.forward_timeout_seconds, meter=metered)

    async def put_file(self, caller: Caller, session_id: str, request: Request) -> Response:
        cap = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise PayloadTooLarge(f"upload over the {cap}-byte cap")
        call, target = await self._file_call(caller, session_id)
        sent = _Counter()
        file_bytes = FileBytes(request.headers.get("content-type"))

        async def stream() -> AsyncIterator[bytes]:
            async for chunk in request.stream():
                sent.n += len(chunk)
                if sent.n > cap:
                    raise _TooLarge()
                file_bytes.feed(chunk)
                yield chunk

        async def metered(status: int, _o: str, _e: float, _m: int) -> Metered:
            return Metered("upload", {usage.BYTES_UPLOADED: file_bytes.count}) if status == 201 else NOTHING

        return await self._forward(call, target, request, "POST", f"/sessions/{session_id}/files",
                                   content=stream(), read_timeout=self.settings.forward_timeout_seconds,
                                   content_length=int(declared) if declared and declared.isdigit() else None,
                                   meter=metered)

    async def _file_call(self, caller: Caller, session_id: str) -> tuple[Call, Target]:
        if not SESSION_ID_PATTERN.fullmatch(session_id):
            raise unknown_session()
        return await self._admitted(caller, session_id)

    # --- the forwarding core --------------------------------------------------------------------

    async def _admitted(self, caller: Caller, session_id: str, body: ExecBody | None = None) -> tuple[Call, Target]:
        """The call and its session's target: admitted by the edge already, or (standalone) here, in the
        one round trip that touches the session and records the call."""
        if caller.admitted is not None:
            spec, target = caller.admitted.spec, caller.admitted.target
        else:
            spec = self.call_spec(body)
            target = await self.store.touch(session_id=session_id, workspace=caller.workspace, now=time.time(),
                                            call=spec)
        if target is None:
            raise unknown_session()
        self.answers.called(session_id)
        return Call(self.store, self.metrics, caller, session_id, spec), target

    async def _forward(
        self, call: Call, target: Target, request: Request, method: str, path: str, *,
        read_timeout: float, content: bytes | AsyncIterator[bytes] | None = None, content_length: int | None = None,
        meter: Callable[[int, str, float, int], Awaitable[Metered]] | None = None, stream: bool = False,
        name_call: bool = False,
    ) -> Response:
        """Send one call to the agent and relay its answer; the call is finished (metered, its record
        removed) once the answer is sent, or the session released as dead. `name_call`: the agent
        gets the call's id (an Execute's, which a cancel names)."""
        session_id = call.session_id
        query = request.scope.get("query_string", b"")
        url = path + ("?" + query.decode("latin-1") if query else "")
        headers = request_headers(request.headers.raw, secret=target.secret, request_id=request_id_var.get() or "")
        if name_call:
            headers.append((CALL_ID, call.call_id))
        try:
            entry = self.clients.take(target.address)
        except BadAddress:
            await self._release_dead(call, target.address)
            raise BadGateway("the session's sandbox has no usable address; the session is gone") from None
        started = time.monotonic()
        # The call is a future of its own so that a release of the session (from any replica: the
        # `released` channel) cuts it short at once instead of leaving it to its exec deadline.
        # A client span when tracing is on (the agent's hop in the caller's trace); free when off.
        with tracing.hop_span(method, url, headers, peer="agent") as span:
            sent = asyncio.ensure_future(entry.pool.request(method, url, headers, body=content,
                                                            content_length=content_length, timeout=read_timeout))
            calls = self._in_flight.setdefault(session_id, set())
            calls.add(sent)
            try:
                upstream = await sent
            except asyncio.CancelledError:
                self.clients.give_back(entry)
                if sent.cancelled() and not _cancelling():  # the session was released, not this request
                    self.clients.forget(target.address)
                    await call.finish()
                    raise SessionEnded("the session was released while the call ran; the session is gone") from None
                self._spawn(call.finish())
                raise
            except _TooLarge:
                self.clients.give_back(entry)
                await call.finish()
                raise PayloadTooLarge(f"upload over the {self.settings.max_body_bytes}-byte cap") from None
            except HopBusy:
                self.clients.give_back(entry)
                await call.finish()
                raise Unavailable("too many calls in flight to this session",
                                  retry_after=self.settings.retry_after_seconds) from None
            except HopConnectError:
                self.clients.give_back(entry)
                await self._release_dead(call, target.address)
                raise SandboxUnavailable("the session's sandbox cannot be reached; the session is gone",
                                         retry_after=self.settings.retry_after_seconds) from None
            except HopError as exc:
                self.clients.give_back(entry)
                await self._release_dead(call, target.address)
                log.warning("sandbox failed mid-call", extra={"session": session_id, "error": type(exc).__name__})
                raise BadGateway("the session's sandbox failed during the call; the session is gone") from None
            except BaseException:
                self.clients.give_back(entry)
                self._spawn(call.finish())
                raise
            finally:
                calls.discard(sent)
                if not calls:
                    self._in_flight.pop(session_id, None)
            span.status(upstream.status)

        if upstream.status == FENCED_STATUS and upstream.header(FENCED) is not None:
            await self._fenced(call, target, entry, upstream)

        if stream and upstream.status == 200 and (upstream.header(b"content-type") or b"").startswith(EVENT_STREAM):
            return self._relay_stream(call, target, entry, upstream, request, started=started, deadline=read_timeout,
                                      meter=meter)

        raw_outcome = (upstream.header(OUTCOME_HEADER) or Outcome.OK.encode()).decode("latin-1")
        outcome = raw_outcome if raw_outcome in EXEC_OUTCOMES else Outcome.FAILED
        status = upstream.status
        headers_out = response_headers(upstream.headers)

        declared = upstream.header(b"content-length") or b""
        if declared.isdigit() and int(declared) <= SMALL_ANSWER_BYTES:
            # A small answer (every exec result within the agent's output caps) is read whole and
            # relayed in one piece: cheaper than a stream, and a drop mid-body is still a clean 502.
            try:
                raw = await upstream.read()
            except HopError as exc:
                await self._release_dead(call, target.address)
                log.warning("sandbox failed mid-answer", extra={"session": session_id, "error": type(exc).__name__})
                raise BadGateway("the session's sandbox failed during the call; the session is gone") from None
            except BaseException:
                self._spawn(call.finish())
                raise
            finally:
                await upstream.close()
                self.clients.give_back(entry)
            if meter is not None:
                call.metered = await meter(status, outcome, time.monotonic() - started, len(raw))
            response = Response(raw, status_code=status, background=call.in_background())
            response.raw_headers = headers_out  # the agent's Content-Length: the length just read
            return response

        async def relay() -> AsyncIterator[bytes]:
            moved = 0
            try:
                async for chunk in upstream.chunks():
                    moved += len(chunk)
                    yield chunk
            except HopError as exc:
                log.warning("sandbox failed mid-answer", extra={"session": session_id, "error": type(exc).__name__})
                self._spawn(self._release_dead(call, target.address))
                raise
            finally:
                await upstream.close()
                self.clients.give_back(entry)
            if meter is not None:  # (a relay cut short is finished unmetered by the background task)
                call.metered = await meter(status, outcome, time.monotonic() - started, moved)

        streamed = StreamingResponse(relay(), status_code=status, background=call.in_background())
        streamed.raw_headers = [*headers_out, *streamed.raw_headers]
        return streamed

    def _relay_stream(self, call: Call, target: Target, entry: ClientSlot, upstream: HopResponse,
                      request: Request, *, started: float, deadline: float,
                      meter: Callable[[int, str, float, int], Awaitable[Metered]] | None) -> Response:
        """A streamed Execute (`sessions.stream`): its pump runs as a task of its own, registered as the
        session's call in flight (a release cuts it short) and metered when the agent's stream ends."""
        session_id = call.session_id

        async def metered(outcome: str) -> None:
            label = outcome if outcome in EXEC_OUTCOMES else Outcome.FAILED
            await call.finish(await meter(200, label, time.monotonic() - started, 0) if meter else NOTHING)

        async def cancel() -> None:
            headers = [("authorization", f"Bearer {target.secret}"), ("x-request-id", request_id_var.get() or "")]
            try:
                # Named: the call whose client left, whether it runs or still waits behind another;
                # never the session's running call as such (that may be another client's).
                answer = await entry.pool.request("DELETE", f"/sessions/{session_id}/exec?call_id={call.call_id}",
                                                  headers, timeout=self.settings.forward_timeout_seconds)
                await answer.read()
                await answer.close()
            except HopError as exc:
                log.warning("could not cancel a call whose client left", extra={"session": session_id,
                                                                                "error": type(exc).__name__})

        relay = StreamRelay(
            upstream.chunks(), meter=metered, unmetered=call.finish,
            dead=lambda: self._release_dead(call, target.address),
            ended=lambda: self.clients.forget(target.address), cancel=cancel,
            cancel_on_disconnect=cancel_on_disconnect(request.headers.raw), deadline=deadline)

        async def run() -> None:
            try:
                await relay.pump()
            finally:
                await upstream.close()
                self.clients.give_back(entry)

        task = asyncio.ensure_future(run())
        calls = self._in_flight.setdefault(session_id, set())
        calls.add(task)

        def finished(done: asyncio.Future[Any]) -> None:
            calls.discard(done)
            if not calls and self._in_flight.get(session_id) is calls:
                self._in_flight.pop(session_id, None)
            self._streams.discard(done)
            if not done.cancelled() and done.exception() is not None:
                log.error("stream relay failed", exc_info=done.exception())

        self._streams.add(task)
        task.add_done_callback(finished)
        return EventStreamResponse(relay)

    async def _fenced(self, call: Call, target: Target, entry: ClientSlot, upstream: HopResponse) -> NoReturn:
        """The sandbox refused this session: it serves another one (a lease that a Redis failover
        forgot gave it out twice; DESIGN.md, "Redis") and it is ending. The call did not run; this
        session is released as dead and answered as one whose sandbox is gone."""
        try:
            await upstream.read()
        except HopError:
            pass
        finally:
            await upstream.close()
            self.clients.give_back(entry)
        log.error("a sandbox refused this session: it serves another session (a lease lost in a Redis "
                  "failover); the session is released and the sandbox ends",
                  extra={"session": call.session_id, "address": target.address})
        await self._release_dead(call, target.address)
        raise SandboxUnavailable("the session's sandbox was serving another session (a lease lost in a Redis "
                                 "failover): the call did not run, the session is gone",
                                 retry_after=self.settings.retry_after_seconds)

    def session_released(self, message: str) -> None:
        """A replica released these sessions (one id, or a reaper call's several space-separated): end this
        replica's calls to them now."""
        for session_id in message.split():
            for sent in self._in_flight.get(session_id, ()):
                sent.cancel()

    async def _release_dead(self, call: Call, address: str) -> None:
        """The session's sandbox died under a call: the call ends unmetered, the session is released."""
        self.clients.forget(address)
        await call.finish()
        released = await self.store.release(session_id=call.session_id, workspace=call.caller.workspace,
                                            now=time.time(), mode="dead")
        if released is not None:
            self.metrics.reaped.labels(reason="dead").inc()
            log.warning("session released: its sandbox died", extra={"session": call.session_id,
                                                                     "sandbox": released.sandbox})

    async def _abandon(self, caller: Caller, session_id: str, pool: str) -> None:
        """Release a session whose CreateSession failed on a Redis error (a no-op if it never leased),
        and take it out of the waiters' queue should the lease have queued it.

        Retried with backoff for a bounded time; a second release after the first one went
        through covers a lease script that Redis ran only after that release."""
        pause, give_up_at, releases = 0.2, time.monotonic() + ABANDON_RETRY_SECONDS, 0
        while releases < 2 and time.monotonic() < give_up_at:
            await asyncio.sleep(pause)
            try:
                await self.store.cancel_wait(waiter=session_id, workspace=caller.workspace, pool=pool,
                                             now=time.time())
                released = await self.store.release(session_id=session_id, workspace=caller.workspace,
                                                    now=time.time(), mode="abandoned")
            except StateUnavailable:
                pause = min(pause * 2, 2.0)
                continue
            releases += 1
            pause = max(pause, self.settings.redis_timeout_seconds)
            if released is not None:
                self.metrics.reaped.labels(reason="abandoned").inc()
                log.warning("session released: its CreateSession failed on a Redis error",
                            extra={"session": session_id, "sandbox": released.sandbox})
                return

    def _spawn(self, coro: Awaitable[Any], *, cancel_on_drain: bool = False) -> None:
        """Finish bookkeeping off the request's task (it may be cancelled by a client that left)."""
        task = asyncio.ensure_future(coro)
        tasks = self._abandons if cancel_on_drain else self._background
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def drain(self) -> None:
        for task in [*self._abandons, *self._streams]:
            task.cancel()
        pending = [*self._background, *self._abandons, *self._streams]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await self.answers.stop()
