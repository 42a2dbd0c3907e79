"""Start one agent `Interpreter` in this process, run a cell, print what happened as JSON.

Run as a script by tests/agent/test_self_hardening.py: the interpreter's kill path also kills
the agent's orphans, every other child of the process it runs in, so it must never run inside
pytest (whose children are the suite's Redis and zygotes).

    python interpreter_driver.py '{"python": ..., "workspace": ..., "policy": {...},
                                   "harden": "self" | "unasked" | "preexec", "code": "..."}'
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the suite's kit, as pytest's rootdir sees it
from testkit import alive

from sandpool.agent import hardening, procs, seccomp
from sandpool.agent.execution import ChildStartFailed
from sandpool.agent.interpreter import Interpreter


class Unasked(hardening.SelfHardening):
    """Expects what was asked, but asks the runner for nothing: a runner that skipped its steps."""

    def argv(self) -> list[str]:
        return []


async def main(config: dict) -> dict:
    policy = hardening.ChildPolicy(**config["policy"])
    arch = seccomp.native_arch()
    asked = hardening.SelfHardening(policy, seccomp.program_bytes(arch) if arch else b"")
    harden = {"self": asked, "unasked": Unasked(asked.policy, asked.seccomp_program), "preexec": None}
    preexec_ran = Path(config["workspace"]) / "preexec-ran"
    reaper = procs.ChildReaper()
    asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, reaper.reap)
    child = Interpreter(python=config["python"], workspace=config["workspace"],
                        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, preexec=preexec_ran.touch,
                        harden=harden[config["harden"]], child_reaper=reaper, max_output_bytes=1 << 16,
                        grace_seconds=1.0, spare=False)
    try:
        await child.start()
    except ChildStartFailed:
        return {"started": False, "left": sorted(pid for pid in reaper.watched if alive(pid))}
    try:
        outcome = await child.run(config["code"], timeout=30)
    finally:
        await child.close()
    return {"started": True, "stdout": outcome.stdout, "stderr": outcome.stderr,
            "return_code": outcome.return_code, "preexec_ran": preexec_ran.exists()}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(sys.argv[1])))))
