"""How fast the local provider makes isolated sandboxes ready: refill rate, start latency, CPU.

Drives the real `LocalProvider` (directory, secret, workspace tmpfs, launch,
health check) with a chosen launcher, keeping `--concurrency` creates in flight
and destroying each sandbox as soon as it is ready, the way a pool refills while
clients release sessions (released sandboxes are destroyed in the background, as
the pool controller does). Reports:

- refill rate: sandboxes made ready per second (wall clock), sustained;
- start latency: create() call to agent healthy, p50/p90/p99;
- CPU per sandbox: the launcher's own CPU plus everything the sandboxes ran
  (for the zygote: its RUSAGE_SELF + RUSAGE_CHILDREN, which include the agents
  and their interpreter workers once reaped; for the subprocess launcher: this
  process's RUSAGE_CHILDREN), and this process's own CPU (the provider's side).

    python bench/refill.py --launcher both --count 200 --concurrency 8
    python bench/refill.py --launcher zygote --no-spare   # agent without its spare interpreter

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

from sandpool.pool.provider import PoolSpec
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
        # The zygote's own CPU, plus every sandbox process summed from /proc just before its
        # kill (reaped-rusage misses what a killed PID namespace's init had not waited for).
        sandbox_cpu = (after["cpu_self_seconds"] + after["cpu_killed_sandboxes_seconds"]
                       - zygote_before["cpu_self_seconds"] - zygote_before["cpu_killed_sandboxes_seconds"])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", choices=("zygote", "subprocess", "both"), default="both")
    parser.add_argument("--count", type=int, default=100, help="sandboxes measured per launcher")
    parser.add_argument("--concurrency", type=int, default=8, help="creates in flight")
    parser.add_argument("--warmup", type=int, default=8, help="sandboxes made (and not measured) first")
    parser.add_argument("--spare", action=argparse.BooleanOptionalAction, default=True,
                        help="the agent's spare warmed interpreter")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    kinds = ("zygote", "subprocess") if args.launcher == "both" else (args.launcher,)
    for kind in kinds:
        result = asyncio.run(run(kind, args.count, args.concurrency, args.spare, args.warmup))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
