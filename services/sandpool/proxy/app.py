"""`create_app(settings)`: the public, multi-tenant edge in front of the scheduler.

Per contract request: verify the bearer token (cached), one Redis round trip
(revocation, rate, policy), the image allow-list for CreateSession, then a
byte-for-byte forward with the workspace, its limits and the internal
credential injected. The lifespan owns the Redis client, the pooled HTTP client
to the scheduler and the JWKS refresher; nothing is built at import time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from enum import Enum
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from sandpool import __version__
from sandpool.contract import tenancy
from sandpool.contract.models import ErrorBody
from sandpool.contract.reasons import Reason
from sandpool.core import tracing
from sandpool.core.asgi import ContractApp, OperationFastPath, client_gone
from sandpool.core.errors import Forbidden, Invalid, SandpoolError, install_error_handlers
from sandpool.core.hop import HopError, HopPool, Peer
from sandpool.proxy.admin import build_router
from sandpool.proxy.auth import TokenVerifier
from sandpool.proxy.edge import OPERATION_KEY, REQUEST_ID_KEY, EdgeMiddleware
from sandpool.proxy.forward import BodyTooLarge, Forwarder
from sandpool.proxy.gate import Gate, Stores
from sandpool.proxy.keyring import KeyRing
from sandpool.proxy.metrics import ProxyMetrics
from sandpool.proxy.policy import Effective, PolicyCodec, proxy_ceilings_of
from sandpool.proxy.settings import ProxySettings
from sandpool.state import StateError, close, connect, ping
from sandpool.state.admission import AdmissionStore
from sandpool.state.egress import EgressStore
from sandpool.state.keys import Keys
from sandpool.state.sessions import SessionStore
from sandpool.state.usage import UsageStore

log = logging.getLogger(__name__)

CREATE_BODY_MAX = 64 * 1024  # a CreateSession body is two integers and an image name
READY_TIMEOUT = 2.0


class ImageNotAllowed(Forbidden):
    reason = Reason.IMAGE_NOT_ALLOWED


class DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # Two parsers reading one body must agree on the image: a repeated key is refused, not resolved.
    document = dict(pairs)
    if len(document) != len(pairs):
        raise DuplicateKey("the CreateSession body repeats a key")
    return document


def check_image(body: bytes, effective: Effective) -> None:
    """Refuse a CreateSession naming an image outside the workspace's allow-list (before any lease).

    A body the proxy cannot read is refused here rather than passed on: the
    scheduler must never see an image the proxy did not check. A request naming
    no image gets the operator's default pool, which is always allowed.
    """
    if effective.allowed_images is None:
        return
    try:
        document = json.loads(body, object_pairs_hook=_no_duplicate_keys) if body.strip() else {}
    except ValueError as exc:
        raise Invalid(str(exc) if isinstance(exc, DuplicateKey) else "the CreateSession body is not JSON") from None
    if not isinstance(document, dict):
        raise Invalid("the CreateSession body must be a JSON object")
    image = document.get("image")
    if image is None:
        return
    if not isinstance(image, str):
        raise Invalid("image must be a string")
    if image not in effective.allowed_images:
        raise ImageNotAllowed("this workspace may not use that image",
                              allowed_images=sorted(effective.allowed_images))


async def read_small_body(request: Request, cap: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise BodyTooLarge(f"request body is over the {cap}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(settings: ProxySettings) -> FastAPI:
    settings.check_startable()
    internal_authorization = f"Bearer {settings.resolved_internal_token()}"
    keyring = KeyRing(settings.auth_public_keys, settings.auth_jwks)
    verifier = TokenVerifier(keyring, algorithms=settings.auth_algorithms, audience=settings.auth_audience,
                             leeway=settings.auth_leeway_seconds, cache_size=settings.auth_cache_size)
    metrics = ProxyMetrics()
    codec = PolicyCodec(proxy_ceilings_of(settings))
    create_cap = min(CREATE_BODY_MAX, settings.max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = connect(settings.redis_url, timeout=settings.redis_timeout_seconds)
        keys = Keys(settings.redis_prefix)
        stores = Stores(client=client, admission=AdmissionStore(client, keys), usage=UsageStore(client, keys),
                        sessions=SessionStore(client, keys), egress=EgressStore(client, keys))
        # Readiness probes share the forwarding pool: they test the connections calls use.
        scheduler = HopPool(Peer.from_url(settings.scheduler_url), max_connections=settings.forward_max_connections,
                            connect_timeout=settings.forward_connect_timeout_seconds)
        jwks_client = httpx.AsyncClient(timeout=10.0) if keyring.is_url else None
        refresher: asyncio.Task[None] | None = None
        try:
            await keyring.start(jwks_client)
            log.info("proxy starting", extra={"trusted_kids": keyring.kids(),
                                              "scheduler_url": settings.scheduler_url})
            if settings.auth_jwks:
                refresher = asyncio.create_task(
                    keyring.refresh_forever(jwks_client, settings.auth_jwks_refresh_seconds))
            app.state.gate = Gate(verifier=verifier, keyring=keyring, stores=stores, codec=codec, metrics=metrics,
                                  jwks_client=jwks_client)
            app.state.forwarder = Forwarder(scheduler, max_body_bytes=settings.max_body_bytes,
                                            timeout=settings.forward_timeout_seconds)
            app.state.scheduler = scheduler
            yield
        finally:
            if refresher is not None:
                refresher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await refresher
            await scheduler.aclose()
            if jwks_client is not None:
                await jwks_client.aclose()
            await close(client)
            await tracing.shutdown(app.state.tracer_provider)

    app = ContractApp(title="sandpool proxy", version=__version__, lifespan=lifespan, redirect_slashes=False,
                  description="Authenticated, multi-tenant edge of sandpool: the code-execution contract v1 "
                              "plus the admin API (usage, policy, sessions, revocation).")
    install_error_handlers(app)
    app.include_router(build_router())

    async def contract(request: Request, operation: str) -> Response:
        request.scope[OPERATION_KEY] = operation
        gate: Gate = request.app.state.gate
        principal = await gate.principal(request)
        # Ending a session or stopping its call frees resources: never refused for the rate, never counted.
        effective = await gate.admit(principal, count=operation not in ("DestroySession", "CancelExecution"))
        body = None
        if operation == "CreateSession":
            body = await read_small_body(request, create_cap)
            check_image(body, effective)
        injected = [("authorization", internal_authorization), (tenancy.WORKSPACE, principal.workspace),
                    *effective.headers]
        forwarder: Forwarder = request.app.state.forwarder
        forward = forwarder.forward(request, injected, request.scope[REQUEST_ID_KEY], body=body)
        if operation != "CreateSession":
            return await forward
        # A CreateSession may wait for a sandbox to be started: a client that leaves stops the
        # wait upstream too (the scheduler sees the connection close), so its slot goes on.
        call, gone = asyncio.ensure_future(forward), asyncio.ensure_future(client_gone(request))
        done, _ = await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        if call in done:
            gone.cancel()
            return call.result()
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError, SandpoolError):
            await call
        raise ClientDisconnect()

    app.add_middleware(OperationFastPath, handler=contract)
    app.add_middleware(EdgeMiddleware, metrics=metrics)  # outermost: request ids and metrics for everything
    if not settings.tracing:  # (traced, the contract goes through FastAPI's instrumented stack above)
        app.serve_operations(contract, outer=lambda inner: EdgeMiddleware(inner, metrics=metrics))
    contract_tags: list[str | Enum] = ["contract v1"]  # FastAPI's own type for `tags`
    contract_errors: dict[int | str, dict[str, Any]] = {
        401: {"model": ErrorBody, "description": "No valid bearer token (`cause` says why)"},
        403: {"model": ErrorBody, "description": "CreateSession: `image_not_allowed` by the workspace's policy"},
        429: {"model": ErrorBody, "description": "The workspace's rate, quota or budget (`limit` says which)"},
        503: {"model": ErrorBody, "description": "At capacity, or a dependency down (`reason` says which)"},
    }

    @app.post("/sessions", tags=contract_tags, responses=contract_errors, status_code=201, summary="CreateSession")
    async def create_session(request: Request) -> Response:
        return await contract(request, "CreateSession")

    @app.get("/sessions/{session_id}", tags=["sandpool additions"], responses=contract_errors,
             summary="GetSession: the session's handle (sandpool's addition to contract v1)")
    async def get_session(request: Request, session_id: str) -> Response:
        return await contract(request, "GetSession")

    @app.delete("/sessions/{session_id}", tags=contract_tags, responses=contract_errors, status_code=204,
                summary="DestroySession")
    async def destroy_session(request: Request, session_id: str) -> Response:
        return await contract(request, "DestroySession")

    @app.post("/sessions/{session_id}/exec", tags=contract_tags, responses=contract_errors, summary="Execute")
    async def execute(request: Request, session_id: str) -> Response:
        return await contract(request, "Execute")

    @app.delete("/sessions/{session_id}/exec", tags=["sandpool additions"], responses=contract_errors,
                status_code=204, summary="CancelExecution: stop the session's running call (sandpool's addition)")
    async def cancel_execution(request: Request, session_id: str) -> Response:
        return await contract(request, "CancelExecution")

    @app.get("/sessions/{session_id}/files/list", tags=contract_tags, responses=contract_errors, summary="ListFiles")
    async def list_files(request: Request, session_id: str) -> Response:
        return await contract(request, "ListFiles")

    @app.get("/sessions/{session_id}/files", tags=contract_tags, responses=contract_errors, summary="GetFile")
    async def get_file(request: Request, session_id: str) -> Response:
        return await contract(request, "GetFile")

    @app.post("/sessions/{session_id}/files", tags=contract_tags, responses=contract_errors, status_code=201,
              summary="PutFile")
    async def put_file(request: Request, session_id: str) -> Response:
        return await contract(request, "PutFile")

    @app.get("/healthz", tags=["operations"], summary="Alive")
    async def healthz(request: Request) -> dict[str, str]:
        request.scope[OPERATION_KEY] = "healthz"
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], summary="Can serve: Redis and the scheduler answer")
    async def readyz(request: Request) -> JSONResponse:
        request.scope[OPERATION_KEY] = "readyz"
        gate: Gate = request.app.state.gate
        try:
            redis_ok = await ping(gate.stores.client)
        except StateError:
            redis_ok = False
        if not redis_ok:
            metrics.redis_error()
        scheduler: HopPool = request.app.state.scheduler
        try:
            answer = await scheduler.request("GET", "/healthz", timeout=READY_TIMEOUT)
            await answer.read()
            await answer.close()
            scheduler_ok = answer.status == 200
        except HopError:
            scheduler_ok = False
        ok = redis_ok and scheduler_ok
        return JSONResponse({"status": "ok" if ok else "unavailable", "redis": redis_ok, "scheduler": scheduler_ok},
                            status_code=200 if ok else 503)

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics")
    async def metrics_endpoint(request: Request) -> Response:
        request.scope[OPERATION_KEY] = "metrics"
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.tracer_provider = tracing.instrument(app, "proxy") if settings.tracing else None
    return app
