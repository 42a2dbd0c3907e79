"""Egress for sandboxed code: the proxy URL in its environment, and the relay that carries it out of a local sandbox.

A sandbox with egress has a credential (its provider made it) and a way to the
installation's egress proxy (`sandpool egress`), which admits a connection only
for a leased session whose workspace allows the destination. Sandboxed code gets
the proxy as `http_proxy`/`https_proxy` (lower case, which curl reads, and upper
case, which the rest read), the credential in the URL's password: pip, curl,
requests, httpx and urllib use it unchanged. Loopback is never proxied.

- Kubernetes sandboxes reach the proxy's Service directly (`--egress-proxy host:port`).
- Local sandboxes have no network but loopback, so the agent listens on
  `127.0.0.1:<port>` inside the sandbox's network namespace and relays each
  connection, byte for byte, to the proxy's Unix socket bound into the sandbox
  (`--egress-socket`). The relay reaches that socket and nothing else; it adds
  no trust: the proxy checks the credential on every connection, so code that
  talks to the port directly gains nothing it could not do through the URL.
  A burst that finds the proxy's listen queue full waits for room (2 s at most,
  then 503 with Retry-After): the proxy is up, and its own answer is the one to give.

Without either setting none of this exists: no listener, no task, no variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

from sandpool.agent.settings import AgentSettings
from sandpool.contract.reasons import EGRESS_REFUSALS, EgressRefusal
from sandpool.core.settings import ConfigurationError, read_secret

log = logging.getLogger("sandpool.agent.egress")

PROXY_USER = "sandbox"
"""The user part of the proxy URL (the proxy reads only the password: the credential)."""
NO_PROXY = "localhost,127.0.0.1,::1"
PIP_LAYER = ".local"
"""Where `pip install` puts a session's own packages, under the workspace (a pip-enabled environment puts
its site directory on sys.path; docs/sandboxes.md)."""
MAX_RELAYED = 128
"""Connections the relay carries at once (the egress proxy caps a sandbox lower: 64 by default)."""
BACKLOG = MAX_RELAYED
"""The relay's own listen queue: a burst of sandboxed code's connections waits in it to be accepted (a
full TCP queue drops a SYN, which the client resends only a second later)."""
BUSY_SECONDS = 2.0
"""How long a connection waits for room in the proxy's full listen queue before the relay answers 503."""
CHUNK = 1 << 16


def _answer(reason: EgressRefusal, message: str, *headers: str) -> bytes:
    """The relay's own answer, shaped like the proxy's refusals: status line naming it, refusal word."""
    [status] = EGRESS_REFUSALS[reason].statuses
    lines = [f"HTTP/1.1 {status} sandpool egress: {message}", f"X-Sandpool-Egress-Refusal: {reason}", *headers,
             "Content-Length: 0", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


UNREACHABLE = _answer(EgressRefusal.PROXY_UNREACHABLE, "the egress proxy cannot be reached")
BUSY = _answer(EgressRefusal.PROXY_BUSY, "the egress proxy is busy (its queue stayed full), retry later",
               "Retry-After: 1")


class ProxyBusy(Exception):
    """The proxy's listen queue stayed full for the whole wait."""


class Egress:
    """A sandbox's way out: its proxy URL and, for a local sandbox, the relay behind it."""

    def __init__(self, credential: str, *, workspace: str, proxy: str | None = None,
                 socket_path: str | None = None) -> None:
        self.credential = credential
        self.workspace = workspace
        self.relay = Relay(socket_path) if socket_path is not None else None
        self.proxy = proxy if proxy is not None else f"127.0.0.1:{self.relay.port}"  # type: ignore[union-attr]  # proxy or socket_path

    @property
    def url(self) -> str:
        return f"http://{PROXY_USER}:{self.credential}@{self.proxy}"

    def environment(self, path: str = "") -> dict[str, str]:
        """What sandboxed code's environment gets on top of the agent's clean one (whose PATH is `path`:
        the layer's console scripts come after it)."""
        url = self.url
        layer = os.path.join(self.workspace, PIP_LAYER)
        return {
            "PATH": os.pathsep.join(part for part in (path, os.path.join(layer, "bin")) if part),
            "http_proxy": url, "https_proxy": url, "HTTP_PROXY": url, "HTTPS_PROXY": url,
            "no_proxy": NO_PROXY, "NO_PROXY": NO_PROXY,
            # pip retries a refused tunnel five times with back-off; once says the proxy's reason and stops.
            "PIP_RETRIES": "1",
            "SANDBOX_PIP_LAYER": layer,
        }

    async def start(self) -> None:
        if self.relay is not None:
            await self.relay.start()

    async def aclose(self) -> None:
        if self.relay is not None:
            await self.relay.aclose()


def from_settings(settings: AgentSettings, workspace: str) -> Egress | None:
    """The sandbox's egress, or None when it has none (nothing is started then)."""
    if settings.egress_socket is None and settings.egress_proxy is None:
        return None
    credential = read_secret(settings.egress_credential, settings.egress_credential_file, what="egress credential")
    if not credential:
        raise ConfigurationError("egress needs the sandbox's credential: set SANDPOOL_EGRESS_CREDENTIAL or "
                                 "--egress-credential-file")
    socket_path = str(settings.egress_socket) if settings.egress_socket is not None else None
    return Egress(credential, workspace=workspace, proxy=settings.egress_proxy, socket_path=socket_path)


class Relay:
    """`127.0.0.1:<port>` → the egress proxy's Unix socket, one upstream connection per accepted one.

    The listening socket is bound at once (its port goes into the environment of children started
    before the loop serves it); connections are accepted once `start` ran. A proxy whose listen queue
    is full (a burst from many sandboxes) is waited for, up to `busy_seconds`: it is up, only behind.
    """

    def __init__(self, socket_path: str, *, busy_seconds: float = BUSY_SECONDS) -> None:
        self.socket_path = socket_path
        self.busy_seconds = busy_seconds
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.listener.bind(("127.0.0.1", 0))
            self.listener.listen(BACKLOG)
            self.listener.setblocking(False)
        except OSError:
            self.listener.close()
            raise
        self.port: int = self.listener.getsockname()[1]
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        # backlog again: the server calls listen(2) once more, with 100 unless told
        self._server = await asyncio.start_server(self._serve, sock=self.listener, limit=CHUNK, backlog=BACKLOG)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self._open) >= MAX_RELAYED:
            writer.close()
            return
        assert task is not None
        self._open.add(task)
        try:
            try:
                up_reader, up_writer = await self._connect()
            except ProxyBusy as exc:
                log.warning("egress proxy busy", extra={"error": str(exc)})
                await _say(writer, BUSY)
                return
            except OSError as exc:
                log.warning("egress proxy unreachable", extra={"error": exc.strerror or str(exc)})
                await _say(writer, UNREACHABLE)
                return
            try:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
            finally:
                up_writer.close()
        except asyncio.CancelledError:
            pass  # `aclose`: the agent is stopping (ended here, so the server's callback sees a clean end)
        finally:
            self._open.discard(task)
            writer.close()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the proxy, waiting out a full listen queue for up to `busy_seconds`.

        The connect is made here, not by the loop: a non-blocking connect to a Unix socket whose queue is
        full fails with EAGAIN, which uvloop reports as an error (the relay answered 502 to a proxy that
        was up) and asyncio mistakes for a connect in progress. ECONNREFUSED is retried too: some systems
        answer it for a full queue, and on Linux it means nobody listens yet, as while the proxy restarts.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.busy_seconds
        pause = 0.005  # doubled after each attempt, up to 0.1 s
        said = False
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                sock.connect(self.socket_path)
                return await asyncio.open_unix_connection(sock=sock, limit=CHUNK)
            except (BlockingIOError, ConnectionRefusedError) as exc:
                sock.close()
                full = isinstance(exc, BlockingIOError)
                if not said:
                    log.debug("egress proxy's queue is full: waiting" if full else "egress proxy refused: retrying")
                    said = True
                if loop.time() + pause > deadline:
                    if full:
                        raise ProxyBusy(f"its listen queue stayed full for {self.busy_seconds:g} s") from None
                    raise
            except BaseException:
                sock.close()
                raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        else:
            self.listener.close()
        for task in list(self._open):
            task.cancel()
        if self._open:
            await asyncio.gather(*self._open, return_exceptions=True)


async def _say(writer: asyncio.StreamWriter, answer: bytes) -> None:
    with contextlib.suppress(OSError):
        writer.write(answer)
        await writer.drain()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then half-close the other side (a request body's end reaches the proxy)."""
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, RuntimeError):
        writer.close()

