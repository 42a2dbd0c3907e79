"""The contract's reference backend (otari-sandbox-container), started for one run in a cpuacct group of its own.

It is never part of the project and never needed by CI: the bench runs a checkout of it with a
Python that has its dependencies (DEVELOPERS.md, "Benchmarks"). It is one uvicorn process that
starts a runner per session (a child it waits for), with no isolation and no auth, so its
process tree is that process and the runners it forks; the group charges both, runners
included after they are gone.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from procstat import CpuGroup, children_of, machine_seconds, process_seconds


def command(python: str, port: int) -> list[str]:
    """How the reference serves: its app under uvicorn, as its image runs it."""
    return [python, "-m", "uvicorn", "sandbox.exec_server:app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]


class Reference:
    """The reference backend on loopback, from `checkout` with `python`, stopped (and its group removed) by `stop`."""

    token: str | None = None  # the reference has no auth

    def __init__(self, checkout: Path, python: str, port: int) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="sp-reference-"))
        env = {**os.environ, "PYTHONPATH": str(checkout.resolve()),
               "SANDBOX_SESSIONS_ROOT": str(self.data_dir / "sessions")}
        self.proc = subprocess.Popen(command(python, port), cwd=self.data_dir, env=env, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=sys.stderr)
        # Before it has forked anything: it starts a runner only for a session's first call.
        self.group = CpuGroup(f"sandpool-cpu-budget-{os.getpid()}-reference")
        self.group.add(self.proc.pid)
        self.url = f"http://127.0.0.1:{port}"
        try:
            self._wait_healthy()
        except BaseException:  # an interrupted start too: nobody else holds it to stop it
            self.stop()
            raise

    def _wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"cpu_budget: the reference backend exited ({self.proc.returncode}); "
                                 "is --reference a checkout and --reference-python a Python with its dependencies?")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise SystemExit("cpu_budget: the reference backend did not answer /health")

    def at_rest(self, timeout: float = 120.0) -> None:
        """Wait until no session runner is left (its DELETE waits for the runner, but a session the
        churn lost is only reaped by its idle timeout), then a second more, as for sandpool: the
        last exits' kernel work lands in the window."""
        deadline = time.monotonic() + timeout
        while children_of(self.proc.pid):
            if time.monotonic() > deadline:
                raise SystemExit("cpu_budget: the reference backend's runners did not go")
            time.sleep(0.2)
        time.sleep(1.0)

    def back_to(self, _rest: None) -> None:
        """The reference keeps nothing warm: back at rest is its runners gone again."""
        self.at_rest()

    def snapshot(self) -> dict[str, float]:
        return {"tree": self.group.seconds(), "machine": machine_seconds(), "client": process_seconds(os.getpid())}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.group.release()
        shutil.rmtree(self.data_dir, ignore_errors=True)
