"""`create_app(settings)`: `sandpool controller`, the process that alone runs sandboxes.

Its lifespan owns the provider, the pool controller (one leader across
replicas), and the session reaper; its HTTP side is only the probes and
`/metrics` (the pools' gauges are read from Redis at scrape time, here and not
on the request path). The api shares nothing with it but Redis: either may be
restarted without ending a live session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sandpool import __version__
from sandpool.controller.controller import PoolController
from sandpool.controller.metrics import ControllerMetrics
from sandpool.controller.pools import pools_from_settings
from sandpool.controller.provider import Provider, ProviderError
from sandpool.controller.reaper import SessionReaper
from sandpool.controller.settings import ControllerSettings
from sandpool.core.serve import StartFailed
from sandpool.core.tasks import finish
from sandpool.state import StateUnavailable, close, connect
from sandpool.state.keys import Keys
from sandpool.state.sessions import SessionStore

log = logging.getLogger(__name__)


def replica_id() -> str:
    """Names this replica in the leadership key and the sandbox records it makes."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def build_provider(settings: ControllerSettings) -> Provider:
    from sandpool.providers import build_provider as build

    return build(settings.provider, settings)  # fields shared by name (data_dir)


def create_app(settings: ControllerSettings, *, provider: Provider | None = None,
               **controller_options: Any) -> FastAPI:
    """The controller app. `provider` replaces the one built from the settings (tests, tools);
    `controller_options` go to `PoolController` (its timing)."""
    pool_specs = pools_from_settings(settings)
    metrics = ControllerMetrics.create()
    keys = Keys(settings.redis_prefix)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = connect(settings.redis_url, timeout=settings.redis_timeout_seconds,
                        max_connections=settings.redis_max_connections)
        store = SessionStore(redis, keys)
        app.state.store = store
        the_provider = provider if provider is not None else build_provider(settings)
        try:
            await the_provider.start()
        except ProviderError as exc:
            await close(redis)
            raise StartFailed(f"{the_provider.name} provider: {exc}") from exc
        register_metrics = getattr(the_provider, "register_metrics", None)  # its own counters
        if register_metrics is not None:
            register_metrics(metrics.registry)
        options = dict(controller_options)
        if "timing" not in options:  # a whole timing given (tests, tools) is taken as it is
            options = {"reconcile_seconds": settings.reconcile_interval_seconds, **options}
        controller = PoolController(redis, keys, the_provider, pool_specs, replica_id=replica_id(), metrics=metrics,
                                    **options)
        app.state.controller = controller
        app.state.provider = the_provider
        reaper = SessionReaper(store, metrics, interval=settings.reap_interval_seconds, batch=settings.reap_batch)
        app.state.session_reaper = reaper
        stopping = asyncio.Event()
        reaper_task = asyncio.create_task(reaper.run(stopping), name="sandpool-session-reaper")
        controller_task = asyncio.create_task(controller.run(), name="sandpool-pool-controller")
        log.info("controller started", extra={"provider": the_provider.name,
                                              "pools": [p.name for p in pool_specs]})
        try:
            yield
        finally:
            stopping.set()
            await finish(reaper_task)
            # Stepping down destroys the leader's half-made sandboxes: give it time.
            await finish(controller_task, grace=15.0)
            await the_provider.close()
            await close(redis)

    app = FastAPI(title="sandpool controller", version=__version__, lifespan=lifespan, redirect_slashes=False,
                  docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        """Ready: Redis answers and the controller loop runs, leading or standing by."""
        checks: dict[str, str] = {}
        try:
            await request.app.state.store.ping()
            checks["redis"] = "ok"
        except StateUnavailable:
            checks["redis"] = "unreachable"
        controller: PoolController = request.app.state.controller
        checks["controller"] = ("leader" if controller.is_leader else "standby") if controller.running \
            else "not running"
        ready = checks["redis"] == "ok" and controller.running
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
                metrics.redis_error()
                continue
            for state in ("ready", "leased", "starting"):
                metrics.pool_sandboxes.labels(pool=spec.name, state=state).set(getattr(counts, state))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    app.state.settings = settings
    return app


__all__ = ["create_app", "replica_id"]
