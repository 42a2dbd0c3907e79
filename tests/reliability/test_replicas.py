"""Replicas under kills (issue 34, item 5): three `sandpool api` processes and two `sandpool controller`
processes (one leading) on one Redis, behind a round-robin TCP load balancer, under a steady
create/execute load; kill -9 of one api and of the leading controller at once.

What must hold afterwards:

- no live session is lost: sessions holding interpreter state (`x = 42`) answer `print(x)` through
  the load balancer, and every load session answers its calls (a call cut by the kill is retried);
- the standby controller leads within the documented time (docs/controller.md, "Leadership": the
  dead leader's term runs out, then the standby's next try takes it);
- every CreateSession in flight on the killed api was either answered or left no leased sandbox
  behind once the new leader's reaper released what it leased and never answered (at the answer's
  grace): every leased sandbox belongs to a session some client was given.

The sandboxes are started with the local provider's subprocess launcher, where a sandbox is a
process of its own that outlives the controller that made it (with the zygote a controller's
sandboxes die with it unless it runs `--sandboxes-outlive-controller`, which two controllers on one
data dir cannot share). `SANDPOOL_LONG=1` repeats the double kill three times, replacing the killed
processes in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from invariants import leader_service
from sp_harness import LONG, Service, Stack, build_stack
from testkit import free_port, wait_for

from sandpool.state.keys import Keys

POOL = 4
KEEPERS = 3
WORKSPACE = "_standalone"
LEADERSHIP_TERM = 5.0  # docs/controller.md: `SET NX PX 5000`
STANDBY_RETRY = LEADERSHIP_TERM / 5  # a standby tries to take leadership this often
TAKEOVER_BOUND = LEADERSHIP_TERM + STANDBY_RETRY  # the term left at the kill (at most one), then one try
MEASURING = 0.5
"""What the measurement adds to a takeover, on a 2-core host shared with other work: the 50 ms poll, the
probe's own round trip, the standby's loop and the kill itself waiting its turn for a core."""
ANSWER_GRACE = 3.0
"""The apis' `--answer-grace-seconds`: a create the killed api leased but never answered is released this
long after its lease (sessions/answers.py)."""
API_ARGS = ["--capacity-wait-seconds", "8", "--forward-connect-timeout-seconds", "1", "--exec-grace-seconds", "3",
            "--answer-grace-seconds", str(ANSWER_GRACE)]
REAP_INTERVAL = 0.2
CONTROLLER_ARGS = ["--launcher", "subprocess", "--reap-interval-seconds", str(REAP_INTERVAL)]
LOAD_THREADS = 2
# A create may end its capacity wait while no controller leads (the pool drained, nobody refills it).
ALLOWED_CREATE_REFUSALS = ("at_capacity", "start_timeout")
ROUNDS = 3 if LONG else 1


class RoundRobin:
    """A TCP load balancer: each client connection goes to the next backend in turn, and to the one
    after it when that one refuses the connection (a dead replica drops out at once); bytes are copied
    both ways untouched. Served on its own event loop in a thread."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.port = free_port()
        self._turn = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="round-robin", daemon=True)
        self.routed: dict[int, int] = {port: 0 for port in ports}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RoundRobin:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(10)
        return self

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", self.port)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._clients.add(task)
        task.add_done_callback(self._clients.discard)
        first = next(self._turn)
        for i in range(len(self.ports)):
            port = self.ports[(first + i) % len(self.ports)]
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue
            self.routed[port] += 1
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
            return
        writer.close()

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._clients):
                task.cancel()
            await asyncio.gather(*self._clients, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(65536):
            sink.write(chunk)
            await sink.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.close()  # a backend that died drops its client's connection: no answer, as without a balancer


@dataclass
class Record:
    """What the load's clients saw."""

    created: list[str] = field(default_factory=list)
    unanswered_creates: list[tuple[float, str]] = field(default_factory=list)  # (when, the transport error)
    refused_creates: list[Any] = field(default_factory=list)  # (operation, status, body)
    cut_calls: list[tuple[str, str]] = field(default_factory=list)  # (operation, error): retried
    executes: int = 0
    destroyed: list[str] = field(default_factory=list)
    bad: list[Any] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, name: str, value: Any) -> None:
        with self.lock:
            getattr(self, name).append(value)


def load(url: str, stop: threading.Event, record: Record) -> None:
    """Create, execute, destroy, over and over; a new connection per request (so the balancer spreads
    them over the apis). A call cut by a kill is retried; a create cut by one is not (its answer is
    lost: nobody knows the session id)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(base_url=url, timeout=30, limits=limits) as client:
        while not stop.is_set():
            try:
                created = client.post("/sessions", json={})
            except httpx.TransportError as exc:
                record.add("unanswered_creates", (time.time(), type(exc).__name__))
                continue
            if created.status_code != 201:
                reason = created.json().get("reason", "") if created.headers.get("content-type", "").startswith(
                    "application/json") else ""
                (record.refused_creates if reason in ALLOWED_CREATE_REFUSALS else record.bad).append(
                    ("create", created.status_code, created.text[:200]))
                time.sleep(0.2)
                continue
            sid = created.json()["session_id"]
            record.add("created", sid)
            answer = _retried(client, record, "execute", "POST", f"/sessions/{sid}/exec",
                              json={"tool": "code_execution", "input": {"code": "print(6 * 7)"}})
            if answer is None or answer.status_code != 200 or \
                    answer.json()["result_block"]["content"]["stdout"] != "42\n":
                record.add("bad", ("execute", sid, None if answer is None else answer.text[:200]))
            else:
                with record.lock:
                    record.executes += 1
            gone = _retried(client, record, "destroy", "DELETE", f"/sessions/{sid}")
            if gone is None or gone.status_code != 204:
                record.add("bad", ("destroy", sid, None if gone is None else gone.text[:200]))
            else:
                record.add("destroyed", sid)


def _retried(client: httpx.Client, record: Record, operation: str, method: str, path: str,
             **kwargs: Any) -> httpx.Response | None:
    for _ in range(5):
        try:
            return client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            record.add("cut_calls", (operation, type(exc).__name__))
    return None


def port_free(port: int) -> bool:
    """Whether nothing listens on the port any more (a killed service's port can be bound again)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def readyz(service: Service) -> dict[str, Any]:
    try:
        return httpx.get(service.url + "/readyz", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return {}


def sessions_in_redis(stack: Stack) -> set[str]:
    with stack.rdb() as r:
        return set(r.smembers(Keys(stack.prefix).workspace_sessions(WORKSPACE)))


def leased_to(stack: Stack) -> dict[str, str]:
    """Leased sandbox -> its session."""
    keys = Keys(stack.prefix)
    out = {}
    with stack.rdb() as r:
        for name in r.scan_iter(match=keys.sandbox_prefix + "*", count=1000):
            fields = r.hgetall(name)
            if fields.get("state") == "leased":
                out[name[len(keys.sandbox_prefix):]] = fields.get("session", "")
    return out


@pytest.mark.timeout(600 if LONG else 120)
def test_kill_9_of_an_api_and_the_leading_controller_behind_a_balancer(stacks: list[Stack]) -> None:
    stack = build_stack(replicas=2, apis=3, pool_size=POOL, max_sandboxes=POOL * 3, api_args=API_ARGS,
                        controller_args=CONTROLLER_ARGS)
    stacks.append(stack)
    balancer = RoundRobin([api.port for api in stack.apis]).start()
    try:
        with httpx.Client(base_url=balancer.url, timeout=30,
                          limits=httpx.Limits(max_keepalive_connections=0)) as client:
            keepers = []
            for _ in range(KEEPERS):  # one on each api (round robin), each holding state
                sid = client.post("/sessions", json={}).json()["session_id"]
                kept = client.post(f"/sessions/{sid}/exec", json={"tool": "code_execution",
                                                                  "input": {"code": "x = 42"}})
                assert kept.status_code == 200, kept.text
                keepers.append(sid)

            record, stop = Record(), threading.Event()
            workers = [threading.Thread(target=load, args=(balancer.url, stop, record), daemon=True)
                       for _ in range(LOAD_THREADS)]
            for worker in workers:
                worker.start()
            takeovers: list[float] = []
            for round_ in range(ROUNDS):
                wait_for(lambda n=round_: record.executes >= 4 * (n + 1), timeout=60,
                         what="the load under way", state=lambda: record)
                leader = leader_service(stack)
                standby = next(s for s in stack.controllers if s is not leader and s.running())
                api = stack.apis[1]
                killed_at = time.monotonic()
                api.kill9()
                leader.kill9()
                wait_for(lambda s=standby: readyz(s).get("checks", {}).get("controller") == "leader",
                         timeout=TAKEOVER_BOUND + MEASURING + 10, interval=0.05, what="the standby leading",
                         state=lambda s=standby: readyz(s))
                takeovers.append(time.monotonic() - killed_at)
                # Nothing kept the killed processes' ports (a sandbox inheriting the controller's
                # listening socket did: a replacement could not bind it, and connections to it hung).
                assert port_free(api.port) and port_free(leader.port)
                # The load carries on across the takeover; then the killed ones come back, as a
                # supervisor would restart them (a controller on the same port stands by).
                wait_for(lambda n=record.executes: record.executes >= n + 4, timeout=60,
                         what="the load carrying on after the kills", state=lambda: record)
                if round_ + 1 < ROUNDS:
                    stack.replace(api)
                    stack.replace(leader)
            stop.set()
            for worker in workers:
                worker.join(60)
            assert not any(worker.is_alive() for worker in workers)
            print(f"\nreplicas: takeover {', '.join(f'{t:.2f}' for t in takeovers)} s; creates answered "
                  f"{len(record.created)}, unanswered {len(record.unanswered_creates)}, refused "
                  f"{record.refused_creates}; executes {record.executes}; cut calls {record.cut_calls}; "
                  f"routed {balancer.routed}")

            # Every answer the load got was right, and every session it was given worked to its end.
            assert record.bad == [], record.bad[:10]
            assert set(record.destroyed) == set(record.created)

            # No live session lost: the state is there, through the balancer.
            for sid in keepers:
                answer = client.post(f"/sessions/{sid}/exec", json={"tool": "code_execution",
                                                                    "input": {"code": "print(x)"}})
                assert answer.status_code == 200, (sid, answer.text)
                assert answer.json()["result_block"]["content"]["stdout"] == "42\n"

            # The standby led within the documented time.
            assert max(takeovers) <= TAKEOVER_BOUND + MEASURING, takeovers

            # A create cut on the killed api left no leased sandbox behind: one it had not leased yet
            # left none, one it leased but never answered is released by the new leader's reaper at the
            # answer's grace (long past by now, bar a slow machine). Every leased sandbox is a
            # keeper's, every session in Redis one a client holds.
            wait_for(lambda: set(leased_to(stack).values()) == set(keepers)
                     and sessions_in_redis(stack) == set(keepers), timeout=ANSWER_GRACE + REAP_INTERVAL + 10,
                     what="no session but the keepers'", state=lambda: (leased_to(stack), sessions_in_redis(stack),
                                                                         record.unanswered_creates))
    finally:
        balancer.stop()
