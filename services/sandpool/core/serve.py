"""Running a service under uvicorn, with a start that fails in one plain line.

The listening socket is bound before anything else happens, so a port in use is
one line (`port 8080 is in use (choose another with --port)`) before any set-up
or log noise. A start that fails later (bad configuration, a provider that
cannot start) is also one line on stderr, `sandpool <service>: <reason>`, exit
status 2, and the same reason is written to the start-failure file when one is
configured (what Kubernetes calls the termination message; `sandpool up` reads
it to say which of its processes failed and why).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import stat
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from sandpool.core.settings import ConfigurationError

log = logging.getLogger(__name__)

EXIT_START_FAILED = 2
UNIX_PATH_MAX = 107
"""sun_path is 108 bytes with its terminating NUL."""
BACKLOG = 2048
"""Connections a listening socket queues until the service accepts them, so a burst waits instead of being
refused. asyncio's, uvloop's and uvicorn's servers call listen(2) again on a socket they are given, with
their own default (asyncio's and uvloop's: 100) unless passed `backlog=`: every server given a socket bound
here must be passed this."""


class StartFailed(Exception):
    """The service could not start; the message is the one line an operator reads."""


def one_line(exc: BaseException) -> str:
    """An exception as the single line an operator reads (named errors speak for themselves)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, (ConfigurationError, StartFailed)):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now; a busy port is a `StartFailed` naming the flag to change."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise StartFailed(f"port {port} is in use (choose another with --port)") from None
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise StartFailed(f"cannot listen on {host}: no such address here (choose another with --host)") from None
        if exc.errno == errno.EACCES:
            raise StartFailed(f"port {port} needs privileges this process lacks (choose another with --port)") from None
        raise StartFailed(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    # Not inheritable (Python's default): one process serves it. A child started through uvloop's
    # subprocess support keeps every inheritable descriptor whatever its close_fds says, and the
    # local provider's subprocess sandboxes held the controller's port that way, after its death too.
    return sock


def bind_unix(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 (this user's processes only), bound now.

    A socket file left by an earlier run is replaced; anything else at the path is refused.
    """
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise StartFailed(f"{path} is too long for a Unix socket (at most {UNIX_PATH_MAX} bytes)")
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise StartFailed(f"{path} exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        previous = os.umask(0o177)
        try:
            sock.bind(os.fspath(path))
        finally:
            os.umask(previous)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise StartFailed(f"cannot listen on {path}: {exc.strerror}") from None
    return sock  # not inheritable either (bind)


def report_failure(service: str, reason: str, failure_file: Path | None) -> None:
    """Print the one line and leave it where a supervisor looks (best effort)."""
    print(f"sandpool {service}: {reason}", file=sys.stderr, flush=True)
    if failure_file is not None:
        with contextlib.suppress(OSError):
            Path(failure_file).write_text(reason + "\n")


class Server(uvicorn.Server):
    """uvicorn's server, except that a clean stop on SIGTERM/SIGINT is exit status 0.

    uvicorn re-raises the signal once it has shut down, so the process dies of it
    (status 143), which supervisors and `sandpool up` read as a crash.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _recording_lifespan(app: Any, failures: list[BaseException]) -> None:
    """Keep what made the app's start fail: uvicorn logs it as a traceback and moves on."""
    original = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(the_app: Any) -> AsyncIterator[Any]:
        started = False
        try:
            async with original(the_app) as state:
                started = True
                yield state
        except BaseException as exc:
            if not started:
                failures.append(exc)
            raise

    app.router.lifespan_context = lifespan


def serve(service: str, build_app: Callable[[], Any], *, host: str, port: int, unix_socket: Path | None = None,
          failure_file: Path | None = None, **uvicorn_options: Any) -> int:
    """Bind (`unix_socket` rather than host:port when given), build, serve until SIGTERM/SIGINT;
    0 after a clean stop, 2 after a failed start."""
    try:
        sock = bind_unix(unix_socket) if unix_socket is not None else bind(host, port)
    except StartFailed as exc:
        report_failure(service, str(exc), failure_file)
        return EXIT_START_FAILED
    try:
        app = build_app()
    except (ConfigurationError, StartFailed) as exc:
        sock.close()
        report_failure(service, one_line(exc), failure_file)
        return EXIT_START_FAILED
    failures: list[BaseException] = []
    _recording_lifespan(app, failures)
    # No proxy-headers layer: nothing here reads the client's address, and the layer costs
    # every request a scope copy for X-Forwarded-For nobody consults.
    options: dict[str, Any] = {"log_config": None, "access_log": False, "lifespan": "on",
                               "server_header": False, "proxy_headers": False, "backlog": BACKLOG,
                               **uvicorn_options}
    try:
        import uvloop  # noqa: F401 - only whether it is installed; uvicorn imports it by name

        options.setdefault("loop", "uvloop")
    except ImportError:
        pass
    server = Server(uvicorn.Config(app, **options))
    try:
        server.run(sockets=[sock])
    except SystemExit:
        pass  # uvicorn's own exit after a failed lifespan start: reported below, in one line
    finally:
        sock.close()
        if unix_socket is not None:
            with contextlib.suppress(OSError):
                os.unlink(unix_socket)
    if failures or not server.started:
        reason = one_line(failures[0]) if failures else "the server did not start"
        report_failure(service, reason, failure_file)
        return EXIT_START_FAILED
    return 0
