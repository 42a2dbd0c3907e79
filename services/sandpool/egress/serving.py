"""Running the egress proxy as a process, with `core/serve.py`'s conventions for a raw asyncio server.

Every listening socket is bound before anything else, so a busy port is one
line naming the flag to change; a start that fails later is one line too
(`sandpool egress: <reason>`, exit status 2, the same line in the start-failure
file). SIGTERM or SIGINT stops it cleanly (exit status 0): no new connections,
open ones get the grace period, their bytes are metered before the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from sandpool.core.serve import BACKLOG, EXIT_START_FAILED, StartFailed, bind, one_line, report_failure
from sandpool.core.settings import ConfigurationError, dump_settings
from sandpool.egress.resolver import ResolveFailed, StaticResolver, SystemResolver, parse_overrides
from sandpool.egress.server import EgressProxy
from sandpool.egress.settings import EgressSettings
from sandpool.state import Keys, StateError, close, connect
from sandpool.state.egress import EgressStore

log = logging.getLogger("sandpool.egress")

SOCKET_PATH_MAX = 107
"""sun_path is 108 bytes with its terminating NUL."""


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at `path`; a stale socket file is replaced, a live one or another file refused."""
    raw = os.fsencode(path)
    if len(raw) > SOCKET_PATH_MAX:
        raise StartFailed(f"--unix-socket path is {len(raw)} bytes long, at most {SOCKET_PATH_MAX} fit: "
                          "choose a shorter one")
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(path).st_mode
        if not stat.S_ISSOCK(mode):
            raise StartFailed(f"--unix-socket {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise StartFailed(f"--unix-socket {path} is in use by another process")
        except OSError:
            os.unlink(path)  # nobody listens: a stale socket file
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, 0o660)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise StartFailed(f"cannot listen on --unix-socket {path}: {exc.strerror}") from None
    return sock


def bind_all(settings: EgressSettings) -> tuple[list[socket.socket], socket.socket | None]:
    sockets: list[socket.socket] = []
    try:
        sockets.append(bind(settings.host, settings.port))
        if settings.unix_socket is not None:
            sockets.append(bind_unix(settings.unix_socket))
        metrics = None
        if settings.metrics_port is not None:
            try:
                metrics = bind(settings.metrics_host, settings.metrics_port)
            except StartFailed as exc:
                text = str(exc).replace("--port", "--metrics-port").replace("--host", "--metrics-host")
                raise StartFailed(f"metrics {text}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets, metrics


def build_resolver(settings: EgressSettings) -> StaticResolver:
    system = SystemResolver(settings.resolve_timeout_seconds)
    return StaticResolver(parse_overrides(settings.resolve_overrides), fallback=system)


async def _main(settings: EgressSettings, sockets: list[socket.socket], metrics_socket: socket.socket | None,
                started: Callable[[], None]) -> None:
    client = connect(settings.redis_url, timeout=settings.redis_timeout_seconds,
                     max_connections=settings.redis_max_connections)
    store = EgressStore(client, Keys(settings.redis_prefix))
    proxy = EgressProxy(settings, store=store, resolver=build_resolver(settings))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            await store.load_scripts()
            await store.publish_ceiling(settings.egress_allow_ceiling)
        except StateError as exc:  # not fatal: connections get 503 until Redis is back
            log.warning("Redis unreachable at start; credentials cannot be checked until it is back",
                        extra={"error": str(exc)})
        await proxy.start(sockets, metrics_socket)
        started()
        log.info("egress proxy listening", extra={"port": sockets[0].getsockname()[1],
                                                  "ceiling": settings.egress_allow_ceiling})
        await stop.wait()
        log.info("egress proxy stopping", extra={"open_connections": proxy.active})
    finally:
        await proxy.aclose()
        await close(client)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def serve(settings: EgressSettings) -> int:
    """Bind, serve until SIGTERM/SIGINT; 0 after a clean stop, 2 after a failed start."""
    failure_file = settings.start_failure_file
    try:
        sockets, metrics_socket = bind_all(settings)
    except StartFailed as exc:
        report_failure("egress", str(exc), failure_file)
        return EXIT_START_FAILED
    log.info("configuration", extra={"settings": dump_settings(settings)})
    started = False

    def mark() -> None:
        nonlocal started
        started = True

    runner: Callable[..., object] = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    try:
        runner(_main(settings, sockets, metrics_socket, mark))
    except (ConfigurationError, StartFailed, ResolveFailed, ValueError, OSError) as exc:
        if started:
            raise
        report_failure("egress", one_line(exc), failure_file)
        return EXIT_START_FAILED
    finally:
        for sock in (*sockets, metrics_socket):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        if settings.unix_socket is not None:
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.lstat(settings.unix_socket).st_mode):
                    os.unlink(settings.unix_socket)
    return 0

