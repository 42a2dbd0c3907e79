"""One client connection from its first byte to its metering: the egress proxy's whole decision.

In order, and refused at the first step that fails:

1. the request head, within `--max-header-bytes` and `--header-timeout-seconds`
   (`GET /healthz` and `/readyz` in origin form are answered here, unauthenticated);
2. the credential (`Proxy-Authorization: Basic`, its password part) names a
   live session in Redis (407 otherwise), within the per-credential cap and its
   workspace's cap (429);
3. a plain request's absolute http:// URL and body framing are checked (405, 400),
   then the destination (CONNECT authority, or the absolute URL's) is admitted by
   the session's allow-list and by the operator's ceiling (403 naming both);
4. the proxy resolves the name itself and refuses it when any address is
   refused by the address policy (403), whatever the allow-list said;
5. it connects, with a timeout (502/504);
6. a tunnel's first bytes must be a TLS ClientHello whose SNI names the CONNECT
   host; nothing reaches the origin otherwise, and a ClientHello refused for its
   SNI or ECH gets a TLS access_denied alert (bytes that are not one get none: a
   client not speaking TLS could not read it);
7. bytes are relayed until both sides are done or the connection idles out,
   and the connection is metered against the session's workspace.

The credential is never logged, never sent on, and not kept beyond the lookup
(the per-credential count is keyed by its digest).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket

from sandpool.contract.reasons import EgressRefusal
from sandpool.core.serve import BACKLOG
from sandpool.egress import allowlist
from sandpool.egress.hosts import BadHost, Destination, IPAddress, normalise_name, parse_authority
from sandpool.egress.http import (
    ESTABLISHED,
    Refusal,
    RequestHead,
    body_framing,
    client_response_head,
    origin_head,
    parse_absolute,
    read_head,
    refusal_bytes,
)
from sandpool.egress.identity import Caller, Shares, identify
from sandpool.egress.metering import Meter, Usage, now
from sandpool.egress.metrics import EgressMetrics
from sandpool.egress.probes import local_answer
from sandpool.egress.relay import (
    Activity,
    Tally,
    close_quietly,
    copy_chunked,
    copy_exactly,
    linger,
    pump,
    relay_response,
    supervise,
)
from sandpool.egress.resolver import ResolveFailed, Resolver
from sandpool.egress.settings import EgressSettings
from sandpool.egress.tls import ALERT_ACCESS_DENIED, NotClientHello, read_client_hello
from sandpool.state.egress import EgressStore

log = logging.getLogger("sandpool.egress")

POLICY_HINT = "workspace policy egress_allow"
CEILING_HINT = "operator setting egress_allow_ceiling"


class EgressProxy:
    """The proxy's listeners and every connection they accept."""

    def __init__(self, settings: EgressSettings, *, store: EgressStore, resolver: Resolver,
                 metrics: EgressMetrics | None = None) -> None:
        self.settings = settings
        self.store = store
        self.resolver = resolver
        self.metrics = metrics or EgressMetrics()
        self.ceiling = settings.ceiling()
        self.policy = settings.address_policy()
        self.meter = Meter(store, self.metrics)
        self.active = 0
        self.shares = Shares(settings.max_connections_per_credential, settings.max_connections_per_workspace)
        self.servers: list[asyncio.AbstractServer] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._limit = max(settings.max_header_bytes, 65536)
        self.metrics.unsafe.set(1 if settings.unsafe_allow_loopback_for_tests else 0)

    # --- listeners -------------------------------------------------------------------------
    async def start(self, proxy_sockets: list[socket.socket], metrics_socket: socket.socket | None = None) -> None:
        """Serve on already-bound sockets (TCP or Unix); the metrics socket answers /metrics and probes only.
        Each server is passed the backlog the sockets were bound with: it calls listen(2) again, and its
        default of 100 turned bursts of sandboxes' connections away at a full queue."""
        for sock in proxy_sockets:
            if sock.family == socket.AF_UNIX:
                server = await asyncio.start_unix_server(self._accept, sock=sock, limit=self._limit, backlog=BACKLOG)
            else:
                server = await asyncio.start_server(self._accept, sock=sock, limit=self._limit, backlog=BACKLOG)
            self.servers.append(server)
        if metrics_socket is not None:
            self.servers.append(await asyncio.start_server(self._accept_metrics, sock=metrics_socket,
                                                           limit=self._limit, backlog=BACKLOG))
        if self.settings.unsafe_allow_loopback_for_tests:
            log.warning("UNSAFE TEST MODE: loopback destinations are admitted (--unsafe-allow-loopback-for-tests); "
                        "never run this way outside the test suite")

    async def aclose(self) -> None:
        """Stop accepting, give open connections the grace period, cut the rest, write their usage."""
        for server in self.servers:
            server.close()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.settings.shutdown_grace_seconds)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        await self.meter.drain(timeout=15)

    # --- one connection --------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.active += 1
        self.metrics.active.inc()
        try:
            if self.active > self.settings.max_connections:
                await self._refuse(reader, writer, Refusal(EgressRefusal.TOO_MANY_CONNECTIONS,
                                                           "too many connections, retry later", status=503,
                                                           headers={"Retry-After": "1"}))
                return
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass  # the client went away
        except asyncio.CancelledError:
            pass  # cut by a shutdown: end this connection's task quietly (its usage is already recorded)
        except Exception:
            log.exception("egress connection failed")
        finally:
            self.active -= 1
            self.metrics.active.dec()
            await close_quietly(writer)
            self._tasks.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(read_head(reader, max_bytes=self.settings.max_header_bytes),
                                          self.settings.header_timeout_seconds)
        except TimeoutError:
            await self._refuse(reader, writer, Refusal(EgressRefusal.HEAD_TIMEOUT, "request head too slow"))
            return
        except Refusal as refusal:
            await self._refuse(reader, writer, refusal)
            return
        if head is None:
            return
        if head.target.startswith("/") and head.method != "CONNECT":
            await self._answer(head, writer, metrics_listener=False)
            return
        try:
            with self.shares.take(await identify(self.store, head)) as caller:
                if head.method == "CONNECT":
                    await self._tunnel(head, caller, reader, writer)
                else:
                    await self._forward(head, caller, reader, writer)
        except Refusal as refusal:
            if refusal.reason == EgressRefusal.UNAVAILABLE:
                self.metrics.redis_error()
            await self._refuse(reader, writer, refusal)

    # --- the decision ------------------------------------------------------------------------
    def _admit(self, destination: Destination, caller: Caller) -> None:
        if not allowlist.from_stored(caller.binding.allow).admits(destination):
            raise Refusal(EgressRefusal.NOT_ALLOWED, f"{destination} is not on this workspace's egress allow-list "
                                                     f"({POLICY_HINT})")
        if not self.ceiling.admits(destination):
            raise Refusal(EgressRefusal.ABOVE_CEILING, f"{destination} is outside the installation's egress "
                                                       f"ceiling ({CEILING_HINT})")

    async def _addresses(self, destination: Destination) -> list[IPAddress]:
        host = destination.host
        if host.address is not None:
            found = [host.address]
        else:
            try:
                found = await self.resolver.resolve(host.name)
            except ResolveFailed as exc:
                raise Refusal(EgressRefusal.RESOLVE_FAILED, str(exc)) from None
        for address in found:
            why = self.policy.refusal(address)
            if why is not None:
                raise Refusal(EgressRefusal.ADDRESS_REFUSED, f"{host} resolves to a refused address "
                                                             f"({why.replace('_', ' ')}); internal addresses are "
                                                             "never reachable, whatever the allow-list says")
        return found

    async def _connect(self, destination: Destination) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        found = await self._addresses(destination)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.connect_timeout_seconds
        last = ""
        for address in found:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                return await asyncio.wait_for(
                    asyncio.open_connection(str(self.policy.connectable(address)), destination.port), left)
            except TimeoutError:
                last = "timed out"
                break
            except OSError as exc:
                last = exc.strerror or type(exc).__name__
        if last == "timed out" or not last:
            raise Refusal(EgressRefusal.CONNECT_TIMEOUT, f"connecting to {destination} timed out")
        raise Refusal(EgressRefusal.CONNECT_FAILED, f"cannot connect to {destination} ({last})")

    # --- CONNECT --------------------------------------------------------------------------------
    async def _tunnel(self, head: RequestHead, caller: Caller, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        try:
            destination = parse_authority(head.target)
        except BadHost as exc:
            raise Refusal(EgressRefusal.BAD_DESTINATION, f"bad CONNECT authority: {exc}") from None
        self._admit(destination, caller)
        up_reader, up_writer = await self._connect(destination)
        tally = Tally()
        outcome = "refused"
        try:
            writer.write(ESTABLISHED)
            await writer.drain()
            why = await self._check_hello(destination, reader, writer, up_writer, tally)
            if why is not None:
                self.metrics.refused(why)
                log.info("egress refused", extra=self._fields(caller, destination, reason=why))
                return
            activity = Activity()
            outcome = await supervise([pump(reader, up_writer, activity, tally, True),
                                       pump(up_reader, writer, activity, tally, False)],
                                      activity, self.settings.idle_timeout_seconds)
        finally:
            await close_quietly(up_writer)
            self._finish("connect", outcome, caller, destination, tally)

    async def _check_hello(self, destination: Destination, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter, up_writer: asyncio.StreamWriter,
                           tally: Tally) -> EgressRefusal | None:
        """Read the ClientHello and send it on when its SNI names the CONNECT host; else the refusal reason."""
        try:
            hello = await asyncio.wait_for(read_client_hello(reader, max_bytes=self.settings.max_header_bytes),
                                           self.settings.header_timeout_seconds)
        except TimeoutError:
            return EgressRefusal.HELLO_TIMEOUT
        except asyncio.IncompleteReadError:
            return EgressRefusal.HELLO_INCOMPLETE
        except NotClientHello:
            return EgressRefusal.NOT_TLS
        why: EgressRefusal | None = None
        if hello.encrypted:
            why = EgressRefusal.SNI_ENCRYPTED
        elif destination.host.is_literal:
            why = None if hello.server_name is None else EgressRefusal.SNI_MISMATCH
        elif hello.server_name is None:
            why = EgressRefusal.SNI_MISSING
        else:
            try:
                same = normalise_name(hello.server_name) == destination.host.name
            except BadHost:
                same = False
            why = None if same else EgressRefusal.SNI_MISMATCH
        if why is not None:
            with contextlib.suppress(OSError, RuntimeError):
                writer.write(ALERT_ACCESS_DENIED)
                await writer.drain()
            return why
        up_writer.write(hello.raw)
        await up_writer.drain()
        tally.out += len(hello.raw)
        return None

    # --- plain HTTP -------------------------------------------------------------------------------
    async def _forward(self, head: RequestHead, caller: Caller, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        request = parse_absolute(head.target)
        framing = body_framing(head)
        destination = request.destination
        self._admit(destination, caller)
        up_reader, up_writer = await self._connect(destination)
        tally = Tally()
        outcome = "failed"
        try:
            activity = Activity()
            data = origin_head(head, request)
            up_writer.write(data)
            await up_writer.drain()
            tally.out += len(data)
            jobs = []
            if framing.kind == "length" and framing.length:
                jobs.append(copy_exactly(reader, up_writer, framing.length, activity, tally))
            elif framing.kind == "chunked":
                jobs.append(copy_chunked(reader, up_writer, activity, tally))
            outcome = await supervise(jobs, activity, self.settings.idle_timeout_seconds,
                                      ends_all=relay_response(up_reader, writer, activity, tally,
                                                              client_response_head))
            if outcome != "done" and not tally.answered:
                await self._refuse(reader, writer, Refusal(
                    EgressRefusal.BAD_RESPONSE, f"the exchange with {destination} failed before a response"))
        finally:
            await close_quietly(up_writer)
            self._finish("http", outcome, caller, destination, tally)

    # --- bookkeeping ------------------------------------------------------------------------------
    def _fields(self, caller: Caller, destination: Destination, **more: object) -> dict[str, object]:
        return {"workspace": caller.binding.workspace, "session": caller.binding.session,
                "dest_host": str(destination.host), "dest_port": destination.port, **more}

    def _finish(self, kind: str, outcome: str, caller: Caller, destination: Destination, tally: Tally) -> None:
        self.metrics.relayed(kind, outcome, tally.in_, tally.out)
        self.meter.record(Usage(workspace=caller.binding.workspace, session=caller.binding.session,
                                host=str(destination.host), port=destination.port, bytes_in=tally.in_,
                                bytes_out=tally.out, ended_at=now()))
        log.info("egress", extra=self._fields(caller, destination, kind=kind, outcome=outcome,
                                              bytes_in=tally.in_, bytes_out=tally.out))

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, refusal: Refusal) -> None:
        self.metrics.refused(refusal.reason)
        log.info("egress refused", extra={"reason": refusal.reason, "status": refusal.status,
                                          "detail": refusal.message})
        with contextlib.suppress(OSError, RuntimeError):
            writer.write(refusal_bytes(refusal))
            await writer.drain()
            await linger(reader, writer)

    # --- answered here -----------------------------------------------------------------------------
    async def _answer(self, head: RequestHead, writer: asyncio.StreamWriter, *, metrics_listener: bool) -> None:
        response = await local_answer(head, store=self.store, metrics=self.metrics, metrics_listener=metrics_listener,
                                      unsafe=self.settings.unsafe_allow_loopback_for_tests)
        with contextlib.suppress(OSError, RuntimeError):
            writer.write(response)
            await writer.drain()

    async def _accept_metrics(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(read_head(reader, max_bytes=self.settings.max_header_bytes),
                                          self.settings.header_timeout_seconds)
            if head is not None:
                await self._answer(head, writer, metrics_listener=True)
        except (TimeoutError, Refusal, ConnectionError, OSError):
            pass
        finally:
            await close_quietly(writer)
