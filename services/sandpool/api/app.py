"""`create_app(settings)`: the request path in one process, the edge over the session layer.

Per contract request the edge verifies the bearer token (cached), makes its
admission round trip (revocation, rate, policy) and, for CreateSession, checks
the image; then it hands the session layer a `Caller` (the workspace and the
limits in force) in process. `--no-auth` is the session layer alone, with the
one standalone caller. The lifespan owns the Redis client, the agents'
connection pools, the waiters' listener and the JWKS refresher; nothing is
built at import time. The api creates and destroys no sandbox: that is the
controller's (`sandpool controller`), which shares only Redis with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.routing import Route

from sandpool import __version__
from sandpool.api.contract import Contract
from sandpool.api.settings import ApiSettings
from sandpool.contract.operations import ROUTES
from sandpool.core import tracing
from sandpool.core.asgi import ContractApp, OperationFastPath
from sandpool.core.errors import install_error_handlers
from sandpool.core.tasks import finish
from sandpool.edge.admin import build_router
from sandpool.edge.auth import TokenVerifier
from sandpool.edge.edge import OPERATION_KEY, EdgeMiddleware
from sandpool.edge.gate import Gate, Stores
from sandpool.edge.keyring import KeyRing
from sandpool.edge.policy import PolicyCodec, proxy_ceilings_of
from sandpool.mcp.http import PATH as MCP_PATH
from sandpool.mcp.http import McpEndpoint
from sandpool.sessions.forward import AgentClients
from sandpool.sessions.limits import Ceilings
from sandpool.sessions.metrics import ApiMetrics
from sandpool.sessions.pools import PoolDirectory, pools_from_settings
from sandpool.sessions.service import SessionLayer
from sandpool.sessions.waiting import Waiters
from sandpool.state import StateUnavailable, channels, close, connect
from sandpool.state.admission import AdmissionStore
from sandpool.state.egress import EgressStore
from sandpool.state.keys import Keys
from sandpool.state.sessions import SessionStore
from sandpool.state.usage import UsageStore

log = logging.getLogger(__name__)

SUMMARIES = {
    "CreateSession": ("contract v1", 201), "GetSession": ("sandpool additions", 200),
    "DestroySession": ("contract v1", 204), "Execute": ("contract v1", 200),
    "CancelExecution": ("sandpool additions", 200), "ListFiles": ("contract v1", 200),
    "GetFile": ("contract v1", 200), "PutFile": ("contract v1", 201),
}
"""The OpenAPI tag and success status of each operation."""


def create_app(settings: ApiSettings) -> FastAPI:
    """The api app. Refuses (ConfigurationError) a configuration without a clear mode."""
    settings.check_startable()
    pool_specs = pools_from_settings(settings)
    pools = PoolDirectory(pool_specs)
    metrics = ApiMetrics()
    keys = Keys(settings.redis_prefix)
    auth = settings.auth
    keyring = KeyRing(settings.auth_public_keys, settings.auth_jwks) if auth else None
    codec = PolicyCodec(proxy_ceilings_of(settings))
    ceilings = {**Ceilings.from_settings(settings).workspace, **codec.proxy_ceilings}
    """Every limit's ceiling, from this process's own settings (the admin API's policy view and checks)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = connect(settings.redis_url, timeout=settings.redis_timeout_seconds,
                        max_connections=settings.redis_max_connections)
        store = SessionStore(redis, keys)
        clients = AgentClients(max_clients=settings.agent_clients_max,
                               connect_timeout=settings.forward_connect_timeout_seconds)
        waiters = Waiters(redis, keys, store)
        sessions = SessionLayer(settings, store, clients, metrics, pools, waiters)
        app.state.sessions = sessions
        app.state.store = store
        app.state.gate = None
        try:
            await store.load_scripts()
        except StateUnavailable as exc:
            # Not fatal: /readyz says not ready until Redis answers; scripts load on first use.
            log.warning("redis unreachable at start", extra={"error": type(exc).__name__})
        stopping = asyncio.Event()
        tasks = [
            asyncio.create_task(waiters.run(), name="sandpool-waiters"),
            asyncio.create_task(sessions.answers.run(), name="sandpool-answers"),
            asyncio.create_task(channels.listen(redis, keys.released_sessions, sessions.session_released,
                                                while_=lambda: not stopping.is_set()),
                                name="sandpool-released-sessions"),
        ]
        jwks_client = httpx.AsyncClient(timeout=10.0) if keyring is not None and keyring.is_url else None
        try:
            if keyring is not None:
                await keyring.start(jwks_client)
                if settings.auth_jwks:
                    tasks.append(asyncio.create_task(
                        keyring.refresh_forever(jwks_client, settings.auth_jwks_refresh_seconds),
                        name="sandpool-jwks-refresh"))
                verifier = TokenVerifier(keyring, algorithms=settings.auth_algorithms,
                                         audience=settings.auth_audience, leeway=settings.auth_leeway_seconds,
                                         cache_size=settings.auth_cache_size)
                stores = Stores(client=redis, admission=AdmissionStore(redis, keys), usage=UsageStore(redis, keys),
                                sessions=store, egress=EgressStore(redis, keys))
                app.state.gate = Gate(verifier=verifier, keyring=keyring, stores=stores, codec=codec,
                                      metrics=metrics, jwks_client=jwks_client, ceilings=ceilings)
            log.info("api started", extra={"mode": "multi-tenant" if auth else "standalone",
                                           "pools": [p.name for p in pool_specs],
                                           "trusted_kids": keyring.kids() if keyring is not None else []})
            async with mcp.serving(redis):  # /mcp: the SDK's session manager runs with the app
                yield
        finally:
            stopping.set()
            for task in tasks:
                await finish(task)
            await sessions.drain()
            await clients.aclose()
            if jwks_client is not None:
                await jwks_client.aclose()
            await close(redis)
            await tracing.shutdown(app.state.tracer_provider)

    app = ContractApp(title="sandpool api", version=__version__, lifespan=lifespan, redirect_slashes=False,
                      description="sandpool's request path: the code-execution contract v1 and sandpool's "
                                  "additions; with auth on, the admin API (usage, policy, sessions, revocation).")
    install_error_handlers(app)
    if auth:
        app.include_router(build_router())

    contract = Contract(settings, metrics)
    redis_down = contract.errors
    # /mcp: MCP tools calling the contract in process (inside the edge's request ids and metrics).
    mcp = McpEndpoint(EdgeMiddleware(contract.asgi, metrics=metrics), contract.authenticate, keys)
    app.router.routes.append(Route(MCP_PATH, mcp, include_in_schema=False))

    async def _redis_down(_: Request, exc: Exception) -> Response:
        answer = redis_down(exc)
        assert answer is not None
        return answer

    app.add_exception_handler(StateUnavailable, _redis_down)

    # The router knows the operations too (the fast path answers them first): a wrong method on a
    # contract path is 405 rather than 404, the OpenAPI document lists them, and with tracing on
    # they go through FastAPI's instrumented stack.
    for method, path, operation in ROUTES:
        tag, status = SUMMARIES[operation]
        app.add_api_route(path, _route(contract.handle, operation), methods=[method], name=operation,
                          summary=operation, tags=[tag], status_code=status)

    @app.get("/healthz", tags=["operations"], summary="Alive")
    async def healthz(request: Request) -> dict[str, str]:
        request.scope[OPERATION_KEY] = "healthz"
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], summary="Can serve: Redis answers")
    async def readyz(request: Request) -> JSONResponse:
        request.scope[OPERATION_KEY] = "readyz"
        try:
            await request.app.state.store.ping()
            redis = "ok"
        except StateUnavailable:
            metrics.redis_error()
            redis = "unreachable"
        ready = redis == "ok"
        return JSONResponse({"status": "ready" if ready else "not ready", "checks": {"redis": redis}},
                            status_code=200 if ready else 503)

    @app.get("/metrics", tags=["operations"], summary="Prometheus metrics")
    async def metrics_endpoint(request: Request) -> Response:
        request.scope[OPERATION_KEY] = "metrics"
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(OperationFastPath, handler=contract.handle, errors=redis_down)
    app.add_middleware(EdgeMiddleware, metrics=metrics)  # outermost: request ids and metrics for everything
    if not settings.tracing:  # (traced, the contract goes through FastAPI's instrumented stack above)
        app.serve_operations(contract.handle, errors=redis_down,
                             outer=lambda inner: EdgeMiddleware(inner, metrics=metrics))
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.tracer_provider = tracing.instrument(app, "api") if settings.tracing else None
    return app


def _route(serve: Callable[[Request, str], Awaitable[Response]], operation: str) -> Callable[..., Any]:
    async def endpoint(request: Request) -> Response:
        return await serve(request, operation)
    return endpoint


__all__ = ["create_app"]
