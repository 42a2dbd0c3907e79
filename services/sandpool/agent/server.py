"""`serve(settings)`: run one agent until SIGTERM/SIGINT, then kill every child and return.

Usable from a freshly forked child of a template process that already imported
the agent: all work happens here, none at import. Before serving, the agent
becomes a child subreaper (so processes that escape their worker with setsid or
a double fork are still its descendants and die with it) and undumpable (so
sandboxed code running under the same uid cannot read its memory or
environment, where the secret is). The interpreter and shell are started and
warmed in the lifespan, before the socket accepts its first connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from sandpool.agent import procs
from sandpool.agent.app import create_app
from sandpool.agent.settings import AgentSettings
from sandpool.core.serve import BACKLOG
from sandpool.core.settings import ConfigurationError, dump_settings

log = logging.getLogger("sandpool.agent")


def _clear_stale_socket(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigurationError(f"--uds {path} exists and is not a socket")
    os.unlink(path)


class _AgentServer(uvicorn.Server):
    """uvicorn's server that kills the children first on SIGTERM/SIGINT and returns instead of re-raising,
    and says `ok` on its launcher's descriptor once it accepts connections."""

    def __init__(self, config: uvicorn.Config, ready_fd: int | None = None) -> None:
        super().__init__(config)
        self.ready_fd = ready_fd

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.report_ready()

    def report_ready(self) -> None:
        """`ok` when serving, then close: the launcher learns the agent is up without polling it, and
        reads end-of-file instead when the start failed (this is also called on the way out).

        Nobody reading any more (the launcher was killed or gave the start up before it could record
        this process) means nobody will ever lease, find or destroy this sandbox: the agent stops
        rather than live on as an orphan."""
        fd, self.ready_fd = self.ready_fd, None
        if fd is None:
            return
        try:
            if self.started and not self.should_exit:
                os.write(fd, b"ok")
        except BrokenPipeError:
            log.warning("the launcher stopped waiting for this agent before it served: stopping")
            self.should_exit = True
        except OSError:
            pass  # the launcher's own timeout reports that
        finally:
            os.close(fd)

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

    def end_fenced(self) -> None:
        """The session fence refused a call (its children are already killed): exit as on SIGTERM, so
        the provider reports the sandbox lost and the controller replaces it."""
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        runtime = getattr(self.config.app, "runtime", None)
        if runtime is not None and not self.should_exit:
            runtime.stop_now()
        super().handle_exit(sig, frame)


def serve(settings: AgentSettings) -> None:
    secret = settings.secret()
    workspace = str(settings.workspace_dir())
    procs.become_subreaper()
    procs.make_undumpable()
    if settings.ready_fd is not None:
        os.set_inheritable(settings.ready_fd, False)  # the agent's to close: no child may hold it open
    app = create_app(settings, secret, workspace=workspace)
    if settings.uds is not None:
        _clear_stale_socket(str(settings.uds))
        config = uvicorn.Config(app, uds=str(settings.uds), log_config=None, access_log=False,
                                lifespan="on", timeout_graceful_shutdown=5, proxy_headers=False, backlog=BACKLOG)
    else:
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=False,
                                lifespan="on", timeout_graceful_shutdown=5, proxy_headers=False, backlog=BACKLOG)
    if log.isEnabledFor(logging.INFO):  # the zygote's agents log at warning: no settings dump per sandbox
        log.info("agent starting", extra={"settings": dump_settings(settings)})
    server = _AgentServer(config, ready_fd=settings.ready_fd)
    app.core.on_fenced = server.end_fenced  # a call for a second session ends this sandbox (agent.fence)
    try:
        server.run()
    finally:
        server.report_ready()
        if settings.uds is not None:
            try:
                os.unlink(settings.uds)
            except OSError:
                pass
        # Belt and braces: nothing sandboxed outlives the agent, even if the lifespan did not finish.
        procs.kill_trees(set(), keep=set(), include_roots=False)
    if not server.started:
        raise SystemExit(1)
