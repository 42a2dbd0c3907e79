"""The local provider tells its loss listener at once when a sandbox's agent exits on its own.

The zygote reports every sandbox that exits without being asked to (its `exit`
event); the provider passes that on as `failed`. Its own destroys, and a sandbox
that dies while it is being created, are not losses.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from sandpool.controller.provider import PoolSpec, ProviderError
from sandpool.providers.local import procs
from sandpool.providers.local.provider import LocalProvider
from sandpool.providers.local.settings import LocalProviderSettings
from sandpool.providers.local.zygote import ZygoteError

POOL = PoolSpec(name="default", image="python")


async def test_an_agent_that_dies_reaches_the_listener_and_a_destroy_does_not(data_dir: Path) -> None:
    provider = LocalProvider(LocalProviderSettings(data_dir=data_dir, start_timeout_seconds=30, launcher="zygote"))
    try:
        await provider.start()
    except (ProviderError, ZygoteError) as exc:
        pytest.skip(f"no zygote here ({exc}): only it reports sandboxes that exit on their own")
    told: list[tuple[str, str]] = []
    at: dict[str, float] = {}

    def listener(sandbox_id: str, reason: str) -> None:
        told.append((sandbox_id, reason))
        at[sandbox_id] = time.monotonic()

    try:
        provider.on_lost(listener)
        await provider.create(POOL, "sb-dies")
        await provider.create(POOL, "sb-kept")
        handle = procs.ProcessHandle.from_line((data_dir / "sandboxes" / "sb-dies" / "agent.pid").read_text())
        killed = time.monotonic()
        os.killpg(handle.pgid, signal.SIGKILL)  # the OOM killer, or a crash
        deadline = killed + 10
        while "sb-dies" not in at and time.monotonic() < deadline:  # noqa: ASYNC110 - a test's bounded wait
            await asyncio.sleep(0.005)
        assert told == [("sb-dies", "failed")]
        print(f"\nloss window (local agent killed): {at['sb-dies'] - killed:.3f} s")
        await provider.destroy("sb-kept")
        await provider.destroy("sb-dies")
        await asyncio.sleep(0.2)
        assert told == [("sb-dies", "failed")]  # destroys are no losses
    finally:
        await provider.close()
