"""Memory of an idle local sandbox (PSS), its start latency, and what a first `import numpy, pandas` costs.

Starts `--count` sandboxes through the real `LocalProvider` (the zygote launcher, the
environment the provider finds: see docs/sandboxes.md), one after another, lets
them settle, then sums PSS (`/proc/<pid>/smaps_rollup`) over each sandbox's
processes (agent, interpreter, spare interpreter, shell). PSS splits shared pages
among their sharers, so compare runs with the same `--count`. Then each sandbox
runs `--first-call` once (wall time through its agent) and PSS is read again.

    python bench/sandbox_memory.py --count 4
    SANDPOOL_SANDBOX_PYTHON=/usr/bin/python3 python bench/sandbox_memory.py   # the host's Python
    SANDPOOL_POOLS_FILE=pools.yaml python bench/sandbox_memory.py   # e.g. `python` with preimport

Needs root for the isolated (zygote) path. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from sandpool.controller.provider import PoolSpec
from sandpool.providers.local.procs import ProcessHandle
from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            tree.setdefault(int(stat[stat.rfind(")") + 2:].split()[1]), []).append(int(entry))
    return tree


def _tree(pid: int) -> list[int]:
    tree, found, todo = _children(), [pid], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def sandbox_pss_mib(data_dir: Path, sandbox_id: str) -> float:
    handle = ProcessHandle.from_line((data_dir / "sandboxes" / sandbox_id / "agent.pid").read_text())
    assert handle is not None
    return sum(_pss_kib(pid) for pid in _tree(handle.pid)) / 1024


async def run(count: int, first_call: str, settle: float) -> dict[str, object]:
    data_dir = Path(tempfile.mkdtemp(prefix="spm", dir="/tmp"))
    data_dir.chmod(0o711)
    provider = LocalProvider(LocalProviderSettings(data_dir=data_dir))
    await provider.start()
    pool = PoolSpec(name="bench", image="python")
    environment = getattr(provider, "environment_for", lambda _pool: None)(pool)  # None: before environments
    try:
        starts, infos = [], []
        for i in range(count):
            t0 = time.perf_counter()
            infos.append(await provider.create(pool, f"m{i}"))
            starts.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(settle)
        idle = [sandbox_pss_mib(data_dir, info.sandbox_id) for info in infos]
        calls = []
        for info in infos:
            transport = httpx.AsyncHTTPTransport(uds=info.address.removeprefix("unix://"))
            async with httpx.AsyncClient(transport=transport, base_url="http://sandbox", timeout=120,
                                         headers={"Authorization": f"Bearer {info.secret}"}) as client:
                t0 = time.perf_counter()
                response = await client.post("/sessions/s/exec", json={"tool": "code_execution",
                                                                       "input": {"code": first_call}})
                calls.append((time.perf_counter() - t0) * 1000)
                content = response.json()["result_block"]["content"]
                if content.get("return_code"):
                    raise SystemExit(f"the first call failed: {content.get('stderr')}")
        after = [sandbox_pss_mib(data_dir, info.sandbox_id) for info in infos]
    finally:
        await provider.destroy_all()
        await provider.close()
        shutil.rmtree(data_dir, ignore_errors=True)
    return {
        "sandbox_python": environment.python if environment else provider.sandbox_python,
        "preimport": list(environment.preimport) if environment else [],
        "count": count,
        "start_ms": {"median": round(statistics.median(starts), 1), "all": [round(s) for s in starts]},
        "idle_pss_mib": {"mean": round(statistics.fmean(idle), 1), "all": [round(p, 1) for p in idle]},
        "first_call": first_call,
        "first_call_ms": {"median": round(statistics.median(calls), 1), "all": [round(c) for c in calls]},
        "pss_after_first_call_mib": round(statistics.fmean(after), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=4, help="sandboxes measured at once")
    parser.add_argument("--first-call", default="import numpy, pandas", help="code each sandbox runs once")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds idle before PSS is read")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.count, args.first_call, args.settle)), indent=2))


if __name__ == "__main__":
    main()
