"""The internal hop's HTTP client: the session layer to a sandbox's agent.

Both ends are ours, speak HTTP/1.1, and sit on loopback, a Unix socket or a
cluster network; what the hop costs is CPU per request, on every call of every
session. httpx spends about 0.8-1 ms of CPU per request here (its transport
layers, anyio, h11); this client is an `asyncio.Protocol` with httptools'
parser (the one uvicorn uses) and spends about 0.05 ms (`bench/cpu_budget.py`,
`docs/performance.md`). It does only what the hops need:

- one pool of keep-alive connections per peer (TCP `host:port`, with socket
  options, or a Unix socket path); an idle connection the peer closed is dropped
  the moment the peer closes it, and idle ones are retired before the peer's own
  keep-alive timeout would close them under a request;
- a request body as bytes or an async iterator of chunks (sent with its
  Content-Length when known, else chunked);
- the response head as soon as it arrives, the body read whole or streamed;
- timeouts for connecting and for the answer; a cancelled request closes its
  connection (never reused half-read).

Errors are `HopConnectError` (no connection: the request was not sent),
`HopBusy` (every connection stayed busy: not sent either), `HopTimeout` (no
answer in time) and `HopError` (the connection failed mid-request or the peer
broke the protocol).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field

import httptools

IDLE_SECONDS = 4.0
"""Idle connections are retired after this: under uvicorn's keep-alive timeout (5 s), so the peer never
closes a connection as a request is being written to it."""
READ_CHUNK_QUEUE = 64
"""Body chunks buffered before the transport stops reading (flow control for streamed answers)."""


class HopError(Exception):
    """The connection failed mid-request, or the peer broke HTTP."""


class HopConnectError(HopError):
    """No connection could be made: nothing was sent."""


class HopTimeout(HopError):
    """The peer did not answer in time."""


class HopBusy(HopError):
    """Every connection to the peer stayed busy past the connect timeout: nothing was sent."""


@dataclass(frozen=True)
class Peer:
    """Where a hop goes: `host`/`port` over TCP, or `path` over a Unix socket."""

    host: str = ""
    port: int = 0
    path: str = ""
    socket_options: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def from_url(cls, url: str, *, socket_options: Iterable[tuple[int, int, int]] = ()) -> Peer:
        """`http://host:port` or `unix:///path`; anything else is a ValueError."""
        if url.startswith("unix://"):
            path = url[len("unix://"):]
            if not path.startswith("/"):
                raise ValueError("a unix address must be absolute")
            return cls(path=path)
        if url.startswith("http://"):
            authority = url[len("http://"):].split("/", 1)[0]
            host, sep, port = authority.rpartition(":")
            if not sep or not port.isdigit():
                host, port = authority, "80"
            return cls(host=host.strip("[]"), port=int(port), socket_options=tuple(socket_options))
        raise ValueError("the address must be http://host:port or unix:///path")

    @property
    def authority(self) -> bytes:
        return b"localhost" if self.path else f"{self.host}:{self.port}".encode()


@dataclass
class Response:
    """An answer's head, with its body to read whole (`read`) or stream (`chunks`), then `close`."""

    status: int
    headers: list[tuple[bytes, bytes]]
    _connection: _Connection = field(repr=False)
    read_timeout: float | None = None
    """The longest wait for the next piece of the body (None: no limit)."""
    _closed: bool = field(default=False, repr=False)

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def transport_info(self, name: str) -> object:
        """`asyncio.Transport.get_extra_info` of the connection that carried the answer (`"socket"`, ...)."""
        transport = self._connection.transport
        return transport.get_extra_info(name) if transport is not None else None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks (transfer-decoded), as they arrive."""
        async for chunk in self._connection.body(self.read_timeout):
            yield chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self._connection.body(self.read_timeout)])

    async def close(self) -> None:
        """Give the connection back (or drop it, when the body was not read to its end)."""
        if not self._closed:
            self._closed = True
            self._connection.finish()


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the one request at a time it carries."""

    def __init__(self, pool: HopPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self._head: asyncio.Future[Response] | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._name = b""
        self._chunks: collections.deque[bytes | None] = collections.deque()
        self._more: asyncio.Event | None = None
        self._complete = False
        self._reusable = False
        self._early = False  # the peer answered before the whole request body was sent
        self._error: BaseException | None = None
        self._writable = asyncio.Event()
        self._writable.set()

    # --- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream connection gets a Transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HopError(f"the peer broke HTTP: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._complete:
            self._fail(HopError("the peer closed the connection" + (f": {exc}" if exc else "")))
        self.pool.discard(self)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # --- httptools callbacks ---------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        head = self._head
        if head is not None and not head.done():
            head.set_result(Response(self.parser.get_status_code(), self._headers, self))

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        if self._more is not None:
            self._more.set()
        if len(self._chunks) > READ_CHUNK_QUEUE and self.transport is not None:
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self._complete = True
        self._reusable = self.parser.should_keep_alive()
        self._chunks.append(None)
        if self._more is not None:
            self._more.set()

    # --- one exchange ----------------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
            self._head.exception()  # whoever awaits it still gets it; nobody awaiting is no error
        if self._more is not None:
            self._more.set()
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    async def send(self, head: bytes, body: bytes | AsyncIterator[bytes] | None, chunked: bool) -> None:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self._headers, self._chunks, self._error = [], collections.deque(), None
        self._complete = self._reusable = self._early = False
        self._head = asyncio.get_running_loop().create_future()
        self._more = asyncio.Event()
        if body is None or isinstance(body, (bytes, bytearray)):
            self.transport.write(head + bytes(body or b""))
            return
        self.transport.write(head)
        async for chunk in body:
            if self._head.done():  # answered already (a refusal before reading it all): stop sending
                self._early = True
                return
            if self.closed:
                raise self._error or HopError("the peer closed the connection")
            if chunk:
                self.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            await self._writable.wait()
        if chunked:
            self.transport.write(b"0\r\n\r\n")

    async def response(self) -> Response:
        assert self._head is not None
        return await self._head

    async def body(self, read_timeout: float | None) -> AsyncIterator[bytes]:
        assert self._more is not None
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                if chunk is None:
                    return
                if self.transport is not None and len(self._chunks) < READ_CHUNK_QUEUE // 2:
                    self.transport.resume_reading()
                yield chunk
                continue
            if self._error is not None:
                raise self._error
            self._more.clear()
            try:
                async with asyncio.timeout(read_timeout):
                    await self._more.wait()
            except TimeoutError:
                self._fail(HopTimeout(f"the body stalled for {read_timeout:g}s"))

    def finish(self) -> None:
        """The exchange is over: back to the pool when it ended cleanly, else closed."""
        if self._complete and self._reusable and not self._early and not self.closed and self._error is None:
            self.pool.release(self)
        else:
            self.abort()
            self.pool.discard(self)


class HopPool:
    """Keep-alive connections to one peer; `request` takes one (or makes one) per call."""

    def __init__(self, peer: Peer, *, max_connections: int = 64, connect_timeout: float = 2.0,
                 idle_seconds: float = IDLE_SECONDS) -> None:
        self.peer = peer
        self.max_connections = max_connections
        self.connect_timeout = connect_timeout
        self.idle_seconds = idle_seconds
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._slots = asyncio.Semaphore(max_connections)

    @property
    def in_use(self) -> int:
        return len(self._busy)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                if self.peer.path:
                    _, conn = await loop.create_unix_connection(lambda: _Connection(self), self.peer.path)
                else:
                    sock = socket.socket(socket.AF_INET6 if ":" in self.peer.host else socket.AF_INET,
                                         socket.SOCK_STREAM)
                    try:
                        sock.setblocking(False)
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                        for level, option, value in self.peer.socket_options:
                            sock.setsockopt(level, option, value)
                        await loop.sock_connect(sock, (self.peer.host, self.peer.port))
                    except BaseException:
                        sock.close()
                        raise
                    _, conn = await loop.create_connection(lambda: _Connection(self), sock=sock)
        except TimeoutError:
            raise HopConnectError(f"no connection within {self.connect_timeout:g}s") from None
        except OSError as exc:
            raise HopConnectError(exc.strerror or str(exc)) from None
        return conn

    def _take_idle(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: the warmest
            if not conn.closed and now - conn.idle_since < self.idle_seconds:
                return conn
            conn.abort()
        return None

    def release(self, conn: _Connection) -> None:
        if conn in self._busy:
            self._busy.discard(conn)
            self._slots.release()
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.append(conn)

    def discard(self, conn: _Connection) -> None:
        if conn in self._busy:
            self._busy.discard(conn)
            self._slots.release()
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    async def request(self, method: str, target: str, headers: Iterable[tuple[str, str]] = (), *,
                      body: bytes | AsyncIterator[bytes] | None = None, content_length: int | None = None,
                      timeout: float | None = None) -> Response:
        """Send a request; the answer's head (its body to read or stream, then `close`).

        `content_length` goes with a streamed body of known length (else it is sent chunked).
        """
        lines = [f"{method} {target} HTTP/1.1".encode(), b"host: " + self.peer.authority]
        for name, value in headers:
            lines.append(f"{name}: {value}".encode("latin-1"))
        chunked = False
        if isinstance(body, (bytes, bytearray)):
            lines.append(b"content-length: %d" % len(body))
        elif body is not None:
            if content_length is not None:
                lines.append(b"content-length: %d" % content_length)
            else:
                lines.append(b"transfer-encoding: chunked")
                chunked = True
        elif method in ("POST", "PUT", "PATCH"):
            lines.append(b"content-length: 0")
        head = b"\r\n".join(lines) + b"\r\n\r\n"
        try:
            async with asyncio.timeout(self.connect_timeout):
                await self._slots.acquire()
        except TimeoutError:
            raise HopBusy(f"no free connection within {self.connect_timeout:g}s") from None
        conn = self._take_idle()
        try:
            if conn is None:
                conn = await self._connect()
            self._busy.add(conn)
        except BaseException:
            self._slots.release()
            raise
        try:
            async with asyncio.timeout(timeout):
                await conn.send(head, body, chunked)
                response = await conn.response()
            response.read_timeout = timeout
            return response
        except TimeoutError:
            conn.abort()
            self.discard(conn)
            raise HopTimeout(f"no answer within {timeout:g}s") from None
        except HopError:
            self.discard(conn)
            raise
        except BaseException:
            conn.abort()  # cancelled (or the body's iterator failed): never reuse a half-done exchange
            self.discard(conn)
            raise

    async def aclose(self) -> None:
        for conn in [*self._idle, *self._busy]:
            conn.abort()
        self._idle.clear()
        self._busy.clear()

    def __repr__(self) -> str:
        return f"HopPool({self.peer!r}, idle={len(self._idle)}, busy={len(self._busy)})"

