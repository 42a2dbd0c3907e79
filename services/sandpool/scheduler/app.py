"""The scheduler's ASGI app: `create_app(settings)` plus a lifespan owning every client and task.

The lifespan owns the Redis client, the agent clients, the session reaper and (when
enabled) the pool controller; nothing is built at import time, and tests build
apps with their own settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Scope

from sandpool.contract.operations import ROUTES, operation_of
from sandpool.core import tracing
from sandpool.core.asgi import ContractApp, OperationFastPath, client_gone, session_id_of
from sandpool.core.errors import StateStoreUnavailable, error_response, install_error_handlers
from sandpool.core.request_ids import RequestDone, RequestIdMiddleware
from sandpool.core.responses import ModelResponse
from sandpool.core.serve import StartFailed
from sandpool.pool.provider import PoolSpec, Provider, ProviderError
from sandpool.scheduler.caller import CallerResolver
from sandpool.scheduler.forward import AgentClients
from sandpool.scheduler.limits import Ceilings
from sandpool.scheduler.metrics import SERVICE, SchedulerMetrics
from sandpool.scheduler.pools import PoolDirectory, pools_from_settings
from sandpool.scheduler.reaper import SessionReaper
from sandpool.scheduler.service import Scheduler, read_capped
from sandpool.scheduler.settings import SchedulerSettings
from sandpool.scheduler.waiting import Waiters
from sandpool.state import StateUnavailable, channels, close, connect
from sandpool.state.keys import Keys
from sandpool.state.sessions import SessionStore

log = logging.getLogger(__name__)

ControllerFactory = Callable[..., Any]
"""Builds the pool controller. Called with keyword arguments `settings`, `redis`, `keys`,
`provider`, `pools`, `metrics` (SchedulerMetrics) and `replica_id`; returns an object with
`async run()` (runs until cancelled) and a `running` property (for /readyz)."""

ContractCall = Callable[[Request, "Scheduler"], Awaitable[Response]]

CREATE_BODY_CAP = 64 * 1024
"""A CreateSession body carries two hints; anything near this size is not one."""
def request_metrics(metrics: SchedulerMetrics) -> RequestDone:
    """Request count and latency per contract operation (a closed label set); other paths uncounted."""

    def record(scope: Scope, status: int, seconds: float) -> None:
        operation = operation_of(scope["method"], scope["path"])
        if operation is not None:
            metrics.requests.labels(service=SERVICE, operation=operation, status=str(status)).inc()
            metrics.request_duration.labels(service=SERVICE, operation=operation).observe(seconds)

    return record


def _default_controller_factory(*, redis: Any, keys: Keys, provider: Provider, pools: list[PoolSpec],
                                metrics: SchedulerMetrics, replica_id: str, **_: Any) -> Any:
    from sandpool.pool.controller import PoolController
    from sandpool.pool.metrics import ControllerMetrics

    return PoolController(redis, keys, provider, pools, replica_id=replica_id,
                          metrics=ControllerMetrics.from_scheduler(metrics))


def _build_provider(settings: SchedulerSettings) -> Provider:
    from sandpool.providers import build_provider

    return build_provider(settings.provider, settings)  # fields shared by name (data_dir)


async def _finish(task: asyncio.Task[Any], grace: float = 5.0) -> None:
    """Cancel a background task and wait a bounded time for it (never hang a shutdown)."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=grace)
    if not done:
        log.warning("background task did not stop in time", extra={"task": task.get_name()})
    elif not task.cancelled() and task.exception() is not None:
        log.error("background task failed", exc_info=task.exception())


def _route(serve: Callable[[Request, str], Awaitable[Response]], operation: str) -> Callable[..., Any]:
    async def endpoint(request: Request) -> Response:
        return await serve(request, operation)
    return endpoint


def replica_id() -> str:
    """Names this replica in the controller's leadership key and sandbox records."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def create_app(settings: SchedulerSettings, *, provider: Provider | None = None,
               controller_factory: ControllerFactory | None = None) -> FastAPI:
    """The scheduler app. Refuses (ConfigurationError) a configuration without a clear mode.

    `provider` and `controller_factory` replace the ones built from the settings;
    both are used only when the controller is enabled (`settings.controller`).
    """
    internal_token = settings.resolve_internal_token()
    pool_specs: list[PoolSpec] = pools_from_settings(settings)
    pools = PoolDirectory(pool_specs)
    resolve_caller = CallerResolver(internal_token)
    metrics = SchedulerMetrics()
    keys = Keys(settings.redis_prefix)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = connect(settings.redis_url, timeout=settings.redis_timeout_seconds,
                        max_connections=settings.redis_max_connections)
        store = SessionStore(redis, keys)
        clients = AgentClients(max_clients=settings.agent_clients_max,
                               connect_timeout=settings.forward_connect_timeout_seconds)
        waiters = Waiters(redis, keys, store)
        scheduler = Scheduler(settings, store, clients, metrics, pools, waiters)
        app.state.scheduler = scheduler
        app.state.store = store
        app.state.controller = None
        try:
            await store.load_scripts()
            await store.publish_ceilings(Ceilings.from_settings(settings).workspace)
        except StateUnavailable as exc:
            # Not fatal: /readyz says not ready until Redis answers; scripts load on first use.
            log.warning("redis unreachable at start", extra={"error": type(exc).__name__})
        session_reaper = SessionReaper(store, clients, metrics, interval=settings.reap_interval_seconds,
                                       batch=settings.reap_batch)
        app.state.session_reaper = session_reaper
        stopping = asyncio.Event()
        session_reaper_task = asyncio.create_task(session_reaper.run(stopping), name="sandpool-session-reaper")
        waiters_task = asyncio.create_task(waiters.run(), name="sandpool-waiters")
        released_task = asyncio.create_task(
            channels.listen(redis, keys.released_sessions, scheduler.session_released,
                            while_=lambda: not stopping.is_set()), name="sandpool-released-sessions")
        controller = None
        controller_task: asyncio.Task[None] | None = None
        the_provider: Provider | None = None
        try:
            if settings.controller:
                the_provider = provider if provider is not None else _build_provider(settings)
                try:
                    await the_provider.start()
                except ProviderError as exc:
                    raise StartFailed(f"{the_provider.name} provider: {exc}") from exc
                register_metrics = getattr(the_provider, "register_metrics", None)  # its own counters
                if register_metrics is not None:
                    register_metrics(metrics.registry)
                factory = controller_factory or _default_controller_factory
                controller = factory(settings=settings, redis=redis, keys=keys, provider=the_provider,
                                     pools=pool_specs, metrics=metrics, replica_id=replica_id())
                controller_task = asyncio.create_task(controller.run(), name="sandpool-pool-controller")
                app.state.controller = controller
            log.info("scheduler started", extra={"mode": "standalone" if internal_token is None else "multi-tenant",
                                                 "pools": [p.name for p in pool_specs],
                                                 "controller": settings.controller})
            yield
        finally:
            stopping.set()
            await _finish(session_reaper_task)
            await _finish(waiters_task)
            await _finish(released_task)
            if controller_task is not None:
                # Stepping down destroys the leader's half-made sandboxes: give it time.
                await _finish(controller_task, grace=15.0)
            if the_provider is not None:
                await the_provider.close()
            await scheduler.drain()
            await clients.aclose()
            await close(redis)
            await tracing.shutdown(app.state.tracer_provider)

    app = ContractApp(title="sandpool scheduler", lifespan=lifespan, redirect_slashes=False, docs_url=None,
                  redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    def redis_down(exc: Exception) -> Response | None:
        if not isinstance(exc, StateUnavailable):
            return None
        metrics.redis_errors.labels(service=SERVICE).inc()
        cause = exc.__cause__ or exc
        log.warning("redis call failed", extra={"error": f"{type(cause).__name__}: {exc}"})
        return error_response(StateStoreUnavailable("state store unavailable; retry later", retry_after=1))

    async def _redis_down(_: Request, exc: Exception) -> Response:
        answer = redis_down(exc)
        assert answer is not None
        return answer

    app.add_exception_handler(StateUnavailable, _redis_down)

    # --- the contract: served ahead of FastAPI's router (core.asgi.OperationFastPath) ----------------

    async def create_session(request: Request, scheduler: Scheduler) -> Response:
        caller = resolve_caller(request.headers)
        body = await read_capped(request, CREATE_BODY_CAP)
        handle = await scheduler.create_session(caller, body, client_gone=lambda: client_gone(request))
        return ModelResponse(handle, status_code=201, exclude_unset=True)

    async def get_session(request: Request, scheduler: Scheduler) -> Response:
        handle = await scheduler.get_session(resolve_caller(request.headers), session_id_of(request))
        return ModelResponse(handle, exclude_unset=True)

    async def destroy_session(request: Request, scheduler: Scheduler) -> Response:
        await scheduler.destroy_session(resolve_caller(request.headers), session_id_of(request))
        return Response(status_code=204)

    def forwarded(call: Callable[[Scheduler], Callable[..., Awaitable[Response]]]) -> ContractCall:
        async def handle(request: Request, scheduler: Scheduler) -> Response:
            return await call(scheduler)(resolve_caller(request.headers), session_id_of(request), request)
        return handle

    contract: dict[str, ContractCall] = {
        "CreateSession": create_session, "GetSession": get_session, "DestroySession": destroy_session,
        "Execute": forwarded(lambda s: s.execute), "ListFiles": forwarded(lambda s: s.list_files),
        "GetFile": forwarded(lambda s: s.get_file), "PutFile": forwarded(lambda s: s.put_file),
        "CancelExecution": forwarded(lambda s: s.cancel_exec),
    }

    async def serve_contract(request: Request, operation: str) -> Response:
        return await contract[operation](request, request.app.state.scheduler)

    # The router knows the operations too (the fast path answers them first): a wrong method on a
    # contract path is 405 rather than 404, and the app lists what it serves.
    for method, path, operation in ROUTES:
        app.add_api_route(path, _route(serve_contract, operation), methods=[method], name=operation)

    # --- operations ----------------------------------------------------------------------------

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        checks: dict[str, str] = {}
        try:
            await request.app.state.store.ping()
            checks["redis"] = "ok"
        except StateUnavailable:
            checks["redis"] = "unreachable"
        if settings.controller:
            controller = request.app.state.controller
            checks["controller"] = "ok" if controller is not None and controller.running else "not running"
        ready = all(v == "ok" for v in checks.values())
        return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request) -> Response:
        store: SessionStore = request.app.state.store
        for spec in pool_specs:
            metrics.pool_ceiling.labels(pool=spec.name).set(spec.ceiling)
            try:
                counts = await store.pool_counts(spec.name)
            except StateUnavailable:
                metrics.redis_errors.labels(service=SERVICE).inc()
                continue
            for state in ("ready", "leased", "starting"):
                metrics.pool_sandboxes.labels(pool=spec.name, state=state).set(getattr(counts, state))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    on_done = request_metrics(metrics)
    app.add_middleware(OperationFastPath, handler=serve_contract, errors=redis_down)
    app.add_middleware(RequestIdMiddleware, on_done=on_done)  # outermost: ids for everything
    if not settings.tracing:  # (traced, the contract goes through FastAPI's instrumented stack above)
        app.serve_operations(serve_contract, errors=redis_down,
                             outer=lambda inner: RequestIdMiddleware(inner, on_done=on_done))
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.tracer_provider = tracing.instrument(app, "scheduler") if settings.tracing else None
    return app


__all__ = ["create_app"]
