"""CPU of one runner's replacement in a local sandbox: a call whose runner exits, and the new spare.

Starts one sandbox through the real `LocalProvider` (the zygote launcher and its runner
template), then sends it `--calls` calls of `import os; os._exit(0)`: each ends its
runner, the agent takes the spare for the next call and has a new spare forked (by the
template, where there is one). The zygote and its templates are moved into a cgroup v1
`cpuacct` group of their own before the measured sandbox is made, so the group charges
everything on the sandbox side (the template's forks before they join the sandbox's
groups, the agent, the runners). Reports per call: that group's CPU, the template's own
share, and the wall time of the call.

    python bench/runner_spawn.py --calls 300 --runs 3
    python bench/runner_spawn.py --churn 100 --runs 3     # whole sandboxes instead

`--churn N`: instead, N sandboxes one after another, each created, given five `print(1)`
and destroyed (no control plane): the group's CPU per sandbox, the zygote's, the template's, and
each of the five calls' wall time (p50; the first is a fresh agent's first call).

The calls themselves (the agent's ~0.6 ms, the exit) are the same before and after a change
to how runners are made, so a difference between builds is the runner's making. Needs root.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from procstat import CpuGroup, children_of, cmdline, process_seconds

from sandpool.controller.provider import PoolSpec
from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings

EXIT = "import os; os._exit(0)"


async def _calls(info, count: int, code: str = EXIT) -> list[float]:
    """`count` calls of `code` to one sandbox, one after another: each one's wall time (ms)."""
    transport = httpx.AsyncHTTPTransport(uds=info.address.removeprefix("unix://"))
    walls = []
    async with httpx.AsyncClient(transport=transport, base_url="http://sandbox", timeout=60,
                                 headers={"Authorization": f"Bearer {info.secret}"}) as client:
        for _ in range(count):
            t0 = time.perf_counter()
            response = await client.post("/sessions/s/exec", json={"tool": "code_execution", "input": {"code": code}})
            walls.append((time.perf_counter() - t0) * 1000)
            response.raise_for_status()
    return walls


@contextlib.asynccontextmanager
async def _measured_provider(name: str) -> AsyncIterator[tuple[LocalProvider, PoolSpec, CpuGroup, list[int]]]:
    """A real `LocalProvider` in a data dir of its own, its first sandbox made and destroyed (which
    starts the zygote and its runner templates), and a cpuacct group charging the zygote and the
    templates: (provider, pool, group, the templates' pids). Everything is removed on the way out."""
    data_dir = Path(tempfile.mkdtemp(prefix="rsp", dir="/tmp"))
    data_dir.chmod(0o711)
    provider = LocalProvider(LocalProviderSettings(data_dir=data_dir))
    await provider.start()
    pool = PoolSpec(name="bench", image="python")
    group = CpuGroup(f"{name}-{id(provider)}")
    try:
        first = await provider.create(pool, "first")
        await _calls(first, 1)
        zygotes = [pid for pid in children_of(os.getpid()) if "zygote_server" in cmdline(pid)]
        if len(zygotes) != 1:
            raise SystemExit(f"runner_spawn: expected one zygote, found {zygotes}")
        templates = [pid for pid in children_of(zygotes[0]) if "--template" in cmdline(pid)]
        group.add(zygotes[0], *templates)
        await provider.destroy(first.sandbox_id)
        yield provider, pool, group, [zygotes[0], *templates]
    finally:
        await provider.destroy_all()
        await provider.close()
        group.release()
        shutil.rmtree(data_dir, ignore_errors=True)


async def churn(count: int, runs: int) -> dict[str, object]:
    out: dict[str, list[float]] = {"group_ms": [], "zygote_ms": [], "template_ms": []}
    walls: list[list[float]] = [[] for _ in range(5)]  # each call's wall time, by its place in the session
    async with _measured_provider("runner-churn") as (provider, pool, group, (zygote, *templates)):

        async def one(name: str) -> None:
            info = await provider.create(pool, name)
            for place, wall in enumerate(await _calls(info, 5, "print(1)")):
                walls[place].append(wall)
            await provider.destroy(info.sandbox_id)

        for n in range(runs):
            for i in range(5):
                await one(f"w{n}-{i}")
            await asyncio.sleep(1.0)
            before = group.seconds(), process_seconds(zygote), sum(process_seconds(p) for p in templates)
            for i in range(count):
                await one(f"m{n}-{i}")
            await asyncio.sleep(2.0)  # the last sandboxes reaped
            after = group.seconds(), process_seconds(zygote), sum(process_seconds(p) for p in templates)
            for key, b, a in zip(("group_ms", "zygote_ms", "template_ms"), before, after, strict=True):
                out[key].append(round((a - b) / count * 1000, 2))
    return {"sandboxes": count, "runs": runs, **out, "group_ms_median": statistics.median(out["group_ms"]),
            "call_wall_p50_ms": [round(statistics.median(w), 2) for w in walls]}


async def run(calls: int, runs: int, warmup: int) -> dict[str, object]:
    out: dict[str, list[float]] = {"group_ms": [], "template_ms": [], "wall_p50_ms": []}
    async with _measured_provider("runner-spawn") as (provider, pool, group, (_zygote, *templates)):
        for n in range(runs):
            info = await provider.create(pool, f"m{n}")
            await _calls(info, warmup)
            await asyncio.sleep(0.5)  # the last spare made
            group0, template0 = group.seconds(), sum(process_seconds(pid) for pid in templates)
            walls = await _calls(info, calls)
            await asyncio.sleep(0.5)
            out["group_ms"].append(round((group.seconds() - group0) / calls * 1000, 3))
            out["template_ms"].append(round((sum(process_seconds(p) for p in templates) - template0) / calls * 1000, 3))
            out["wall_p50_ms"].append(round(statistics.median(walls), 2))
            await provider.destroy(info.sandbox_id)
    return {"calls": calls, "runs": runs, **out, "group_ms_median": statistics.median(out["group_ms"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300, help="measured calls per run (one runner replaced each)")
    parser.add_argument("--runs", type=int, default=3, help="runs, each in a fresh sandbox")
    parser.add_argument("--warmup", type=int, default=10, help="calls made (and not measured) first in each sandbox")
    parser.add_argument("--churn", type=int, default=0, help="sandboxes churned per run instead")
    args = parser.parse_args()
    result = asyncio.run(churn(args.churn, args.runs) if args.churn else run(args.calls, args.runs, args.warmup))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
