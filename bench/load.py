"""Load generator against any contract v1 URL: latencies, then concurrent sessions.

    python bench/load.py --url http://127.0.0.1:8080 [--token T] [--duration 15] [--clients 16,64]
    python bench/load.py --start-up [--pool-size 32 --max-sandboxes 96]   # runs `sandpool up --no-auth` itself
    python bench/load.py --start-up --auth                                  # ... or with auth (the api verifies tokens)
    python bench/load.py --start-up --auth --burst 5,20,100 --burst-only     # bursts from a cold pool

Phase 1 (one client, sequential): CreateSession, first `print(1)` (time from CreateSession to
the first result), later `print(1)` and `echo hi`, DestroySession; p50/p99 of each.
Phase 2 (for each --clients N, for --duration seconds): N clients each loop create, 5 x
`print(1)`, destroy; sessions/s, executions/s, CreateSession and Execute p50/p99, and how
many CreateSessions were refused for capacity (503, retried after Retry-After or 50 ms).
Bursts (--burst N,...): N simultaneous CreateSessions on a pool back at its floor; time until all
were served, and how many were refused (503). Loopback numbers only mean something next to the
machine they ran on: the summary says how many cores it had.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PRINT_1 = {"tool": "code_execution", "input": {"code": "print(1)"}}
ECHO_HI = {"tool": "bash_code_execution", "input": {"command": "echo hi"}}


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def ms(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "p50_ms": round(pct(values, 50) * 1000, 2), "p99_ms": round(pct(values, 99) * 1000, 2)}


@dataclass
class Counters:
    create: list[float] = field(default_factory=list)
    first_result: list[float] = field(default_factory=list)
    print1: list[float] = field(default_factory=list)
    echo: list[float] = field(default_factory=list)
    destroy: list[float] = field(default_factory=list)
    sessions: int = 0
    execs: int = 0
    refused: int = 0
    errors: int = 0
    transport_errors: dict[str, int] = field(default_factory=dict)


class Client:
    def __init__(self, http: httpx.AsyncClient, counters: Counters) -> None:
        self.http = http
        self.c = counters

    async def send(self, method: str, path: str, **kwargs: object) -> httpx.Response | None:
        """The response, or None after counting a dropped connection by its kind: a load run
        reports every failure it met instead of stopping at the first."""
        try:
            return await self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            kind = type(exc).__name__
            self.c.transport_errors[kind] = self.c.transport_errors.get(kind, 0) + 1
            return None

    async def create(self, deadline: float) -> tuple[str, float] | None:
        """A session id and when the attempt that got it started; None past the deadline."""
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            response = await self.send("POST", "/sessions", json={})
            if response is None:
                await asyncio.sleep(0.05)
                continue
            if response.status_code == 201:
                self.c.create.append(time.perf_counter() - started)
                return response.json()["session_id"], started
            if response.status_code in (429, 503):
                self.c.refused += 1
                retry = float(response.headers.get("Retry-After", "0") or 0)
                await asyncio.sleep(min(retry, 1.0) if retry else 0.05)
                continue
            self.c.errors += 1
            await asyncio.sleep(0.05)
        return None

    async def execute(self, session: str, body: dict, into: list[float]) -> float:
        started = time.perf_counter()
        response = await self.send("POST", f"/sessions/{session}/exec", json=body)
        done = time.perf_counter()
        if response is None:
            pass
        elif response.status_code != 200:
            self.c.errors += 1
        else:
            into.append(done - started)
            self.c.execs += 1
        return done

    async def destroy(self, session: str) -> None:
        started = time.perf_counter()
        response = await self.send("DELETE", f"/sessions/{session}")
        if response is not None and response.status_code == 204:
            self.c.destroy.append(time.perf_counter() - started)
        elif response is not None:
            self.c.errors += 1


def http_client(url: str, token: str | None, connections: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(base_url=url, headers=headers, timeout=60,
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


@contextlib.asynccontextmanager
async def callers(url: str, token: str | None, count: int) -> AsyncIterator[list[httpx.AsyncClient]]:
    """One HTTP client per simulated caller: independent callers share no connection pool, and
    one shared pool measures httpx more than the service (its pool's cost grows with the
    connections it holds: 64 callers on one pool spent 48.7 ms of client CPU per churned
    session, 21.7 ms with a client each)."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(http_client(url, token, 2)) for _ in range(count)]


async def latencies(url: str, token: str | None, sessions: int, calls: int) -> dict[str, object]:
    counters = Counters()
    async with http_client(url, token, 4) as http:
        client = Client(http, counters)
        for _ in range(sessions):
            got = await client.create(time.perf_counter() + 30)
            if got is None:
                break
            session, started = got
            first_done = await client.execute(session, PRINT_1, [])
            counters.first_result.append(first_done - started)
            for _ in range(calls):
                await client.execute(session, PRINT_1, counters.print1)
                await client.execute(session, ECHO_HI, counters.echo)
            await client.destroy(session)
            counters.sessions += 1
            await asyncio.sleep(0.05)  # idle pacing: measure an idle service, not a drained pool
    return {"create_session": ms(counters.create), "first_result_after_create": ms(counters.first_result),
            "print_1": ms(counters.print1), "echo_hi": ms(counters.echo), "destroy_session": ms(counters.destroy),
            "capacity_refusals": counters.refused, "errors": counters.errors,
            "transport_errors": counters.transport_errors}


async def concurrent(url: str, token: str | None, clients: int, duration: float,
                     calls_per_session: int = 5) -> dict[str, object]:
    counters = Counters()
    deadline = time.perf_counter() + duration

    async def one(http: httpx.AsyncClient) -> None:
        client = Client(http, counters)
        while time.perf_counter() < deadline:
            got = await client.create(deadline)
            if got is None:
                return
            session = got[0]
            for _ in range(calls_per_session):
                await client.execute(session, PRINT_1, counters.print1)
            await client.destroy(session)
            counters.sessions += 1

    async with callers(url, token, clients) as https:
        started = time.perf_counter()
        await asyncio.gather(*(one(http) for http in https))
        elapsed = time.perf_counter() - started
    return {"clients": clients, "seconds": round(elapsed, 2),
            "sessions_per_s": round(counters.sessions / elapsed, 1),
            "execs_per_s": round(counters.execs / elapsed, 1),
            "create_session": ms(counters.create), "execute": ms(counters.print1),
            "destroy_session": ms(counters.destroy), "capacity_refusals": counters.refused,
            "errors": counters.errors, "transport_errors": counters.transport_errors}


async def burst(url: str, token: str | None, size: int) -> dict[str, object]:
    """`size` simultaneous CreateSessions from a cold pool: how long until all were served, and how
    many got 503 (a pool that waits below its ceiling refuses only when full)."""
    async with http_client(url, token, size + 8) as http:
        started = time.perf_counter()

        async def create() -> tuple[int, float, str | None]:
            response = await http.post("/sessions", json={})
            session = response.json().get("session_id") if response.status_code == 201 else None
            return response.status_code, time.perf_counter() - started, session

        answers = await asyncio.gather(*(create() for _ in range(size)))
        served = [seconds for status, seconds, _ in answers if status == 201]
        await asyncio.gather(*(http.delete(f"/sessions/{sid}") for _, _, sid in answers if sid))
    statuses: dict[str, int] = {}
    for status, _, _ in answers:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {"burst": size, "statuses": statuses, "refused_503": statuses.get("503", 0),
            "time_to_all_served_s": round(max(served), 3) if served else None,
            "create_p50_ms": round(pct(served, 50) * 1000, 1) if served else None}


class StartedUp:
    """`sandpool up [--no-auth]` in a subprocess for the run (stopped with SIGTERM after)."""

    def __init__(self, pool_size: int | None, max_sandboxes: int | None, port: int, auth: bool) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="spb"))
        sizes = ([] if pool_size is None else ["--pool-size", str(pool_size)]) + (
            [] if max_sandboxes is None else ["--max-sandboxes", str(max_sandboxes)])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandpool", "up", "--auth" if auth else "--no-auth", "--port", str(port),
             "--data-dir", str(self.data_dir), *sizes, "--log-level", "warning"],
            stdout=subprocess.PIPE, stderr=sys.stderr, start_new_session=True)
        self.url: str | None = None
        self.token: str | None = None
        found = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode().strip()
                if line.startswith("SANDPOOL_URL="):
                    self.url = line.split("=", 1)[1]
                    if not auth:
                        found.set()
                elif line.startswith("SANDPOOL_TOKEN="):
                    self.token = line.split("=", 1)[1]
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(180):
            self.stop()
            raise SystemExit("sandpool up did not print SANDPOOL_URL")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.data_dir, ignore_errors=True)


async def main_async(args: argparse.Namespace, url: str) -> dict[str, object]:
    report: dict[str, object] = {"url": url, "auth": bool(args.token), "cores": os.cpu_count(),
                                 "duration_s": args.duration}
    if args.burst:
        bursts = []
        for size in args.burst:
            await asyncio.sleep(args.settle)  # the pool back at its floor: a burst from cold
            result = await burst(url, args.token, size)
            print(json.dumps(result), flush=True)
            bursts.append(result)
        report["bursts"] = bursts
        if args.burst_only:
            return report
    report["latencies"] = await latencies(url, args.token, args.sessions, args.calls)
    print(json.dumps({"latencies": report["latencies"]}, indent=1), flush=True)
    runs = []
    for clients in args.clients:
        await asyncio.sleep(args.settle)  # let the controller refill the pool between phases
        result = await concurrent(url, args.token, clients, args.duration)
        print(json.dumps(result), flush=True)
        runs.append(result)
    report["concurrent"] = runs
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="base URL of a contract v1 backend (a sandpool api)")
    parser.add_argument("--token", default=None, help="bearer token (a JWT the api trusts)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per concurrent phase")
    parser.add_argument("--clients", default="16,64", help="comma-separated client counts")
    parser.add_argument("--sessions", type=int, default=30, help="sequential sessions in the latency phase")
    parser.add_argument("--calls", type=int, default=10, help="print(1) and echo hi calls per latency session")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds to let the pool refill between phases")
    parser.add_argument("--start-up", action="store_true", help="run `sandpool up --no-auth` for the run")
    parser.add_argument("--auth", action="store_true", help="with --start-up: auth on (the api verifies tokens)")
    parser.add_argument("--pool-size", type=int, default=None, help="with --start-up: warm floor (default: up's)")
    parser.add_argument("--max-sandboxes", type=int, default=None, help="with --start-up: ceiling (default: up's)")
    parser.add_argument("--burst", default="", help="comma-separated burst sizes: N simultaneous creates each, "
                                                    "from a pool back at its floor")
    parser.add_argument("--burst-only", action="store_true", help="run the bursts and nothing else")
    parser.add_argument("--port", type=int, default=18080, help="with --start-up: port")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    args.burst = [int(c) for c in args.burst.split(",") if c.strip()]
    if not args.url and not args.start_up:
        parser.error("give --url or --start-up")
    stack = StartedUp(args.pool_size, args.max_sandboxes, args.port, args.auth) if args.start_up else None
    try:
        url = stack.url if stack else args.url
        if stack and stack.token:
            args.token = stack.token
        assert url
        report = asyncio.run(main_async(args, url))
    finally:
        if stack:
            stack.stop()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
