"""A synchronous handle on real zygote-launched sandboxes, for the isolation tests.

The zygote client is asyncio; the tests are easier to read as plain calls. A
`Harness` runs one event loop in a thread of its own for the whole test session
(that thread starts the zygote, so PDEATHSIG ties the zygote to it), and every
call is submitted to that loop. Code runs in a sandbox through the agent's real
HTTP API over its Unix socket, exactly as the scheduler reaches it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from testkit import log_tail, wait_for

from sandpool.providers.local import fsmount
from sandpool.providers.local.launcher import AgentSecret, SandboxLimits
from sandpool.providers.local.procs import ProcessHandle, is_alive
from sandpool.providers.local.zygote import ZygoteLauncher

T = TypeVar("T")
MIB = 1024 * 1024


@dataclass
class Sandbox:
    sandbox_id: str
    directory: Path
    socket_path: Path
    workspace: Path
    secret: str
    handle: ProcessHandle
    uid: int | None
    client: httpx.Client

    def _post(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        response = self.client.post("/sessions/s/exec", json=body, timeout=timeout,
                                    headers={"Authorization": f"Bearer {self.secret}"})
        assert response.status_code == 200, response.text
        return response.json()["result_block"]["content"]

    def python(self, code: str, *, timeout: float = 20.0) -> dict[str, Any]:
        """Run Python in the sandbox's interpreter; returns stdout, stderr, return_code."""
        return self._post({"tool": "code_execution", "input": {"code": code}, "timeout_seconds": timeout},
                          timeout + 10)

    def bash(self, command: str, *, timeout: float = 20.0) -> dict[str, Any]:
        return self._post({"tool": "bash_code_execution", "input": {"command": command},
                           "timeout_seconds": timeout}, timeout + 10)

    def exec(self, tool: str, fields: dict[str, Any], *, timeout: float = 20.0) -> dict[str, Any]:
        """The whole exec response (extra fields such as limit_exceeded included)."""
        response = self.client.post("/sessions/s/exec", json={"tool": tool, "input": fields,
                                                              "timeout_seconds": timeout},
                                    timeout=timeout + 10, headers={"Authorization": f"Bearer {self.secret}"})
        assert response.status_code == 200, response.text
        return response.json()

    def healthy(self) -> bool:
        try:
            return self.client.get("/healthz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


class Harness:
    def __init__(self, *, disabled: frozenset[str] = frozenset(), restart_interval: float = 5.0,
                 netns_spares: int = 32, runner_template: bool = True) -> None:
        # Under /tmp and traversable by every uid (not pytest's 0700 tmp dir): with the
        # filesystem layer off, sandboxed code reaches its workspace by its host path.
        self.base = Path(tempfile.mkdtemp(prefix="spiso", dir="/tmp"))
        self.base.chmod(0o711)
        self.sandboxes_dir = self.base / "sandboxes"
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="zygote-harness", daemon=True)
        self.thread.start()
        self.launcher = ZygoteLauncher(self.base / "zygote", disabled=disabled, restart_interval=restart_interval,
                                       netns_spares=netns_spares, runner_template=runner_template)
        self.report = self.run(self.launcher.start())
        self.live: list[Sandbox] = []
        self._next_uid = 1_500_000 + (os.getpid() % 1000) * 100

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self, *, memory_mb: int = 256, max_processes: int = 64, workspace_mb: int = 16,
              uid: bool = True, cpu_millis: int | None = None, host_tmpfs: bool = False) -> Sandbox:
        """A sandbox; `host_tmpfs`: its workspace a size-capped tmpfs mounted on the host just before the
        launch, as the local provider mounts one when it runs as root."""
        sandbox_id = "t" + secrets.token_hex(6)
        directory = self.sandboxes_dir / sandbox_id
        directory.mkdir(mode=0o711)
        workspace = directory / "workspace"
        workspace.mkdir(mode=0o700)
        self._next_uid += 1
        sandbox_uid = self._next_uid if uid else None
        if host_tmpfs:
            fsmount.mount_tmpfs(workspace, size=workspace_mb * MIB, uid=sandbox_uid or 0, gid=sandbox_uid or 0)
        if sandbox_uid is not None:
            os.chown(workspace, sandbox_uid, sandbox_uid)
        secret = secrets.token_urlsafe(32)
        secret_file = directory / "secret"
        secret_file.write_text(secret)
        os.chmod(secret_file, 0o600)
        limits = SandboxLimits(uid=sandbox_uid, gid=sandbox_uid, memory_bytes=memory_mb * MIB,
                               max_processes=max_processes, max_open_files=256,
                               max_file_size_bytes=workspace_mb * 4 * MIB, workspace_bytes=workspace_mb * MIB,
                               cpu_millis=cpu_millis)
        # The socket in a directory of its own: the one host directory a sandbox sees.
        (directory / "sock").mkdir(mode=0o700)
        socket_path = directory / "sock" / "agent.sock"
        handle = self.run(self.launcher.launch(sandbox_id, workspace, socket_path,
                                               AgentSecret(secret, secret_file), limits,
                                               log_path=directory / "agent.log"))
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://sandbox")
        sandbox = Sandbox(sandbox_id, directory, socket_path, workspace, secret, handle, sandbox_uid, client)
        self.live.append(sandbox)
        log = directory / "agent.log"

        def healthy() -> bool:
            if not is_alive(handle):
                raise AssertionError(f"the sandbox agent exited: {log_tail(log, 1500) or '(no log)'}")
            return sandbox.healthy()

        wait_for(healthy, timeout=30, interval=0.01, what="the sandbox agent healthy",
                 state=lambda: log_tail(log, 1500) or "(no log)")
        return sandbox

    def kill(self, sandbox: Sandbox) -> None:
        sandbox.client.close()
        self.run(self.launcher.kill(sandbox.handle))
        fsmount.unmount_under(sandbox.directory)
        if sandbox in self.live:
            self.live.remove(sandbox)

    def cgroup(self, sandbox: Sandbox, controller: str) -> Path:
        """The sandbox's top group in one v1 hierarchy (`pids`, `cpu`, `memory`), or its v2 group."""
        bases = [Path(b) for b in self.launcher.client.cgroup_bases]
        chosen = [b for b in bases if f"/{controller}" in str(b)] or bases
        return chosen[0] / sandbox.sandbox_id

    def templates(self) -> list[int]:
        """The zygote's runner templates (their pids), which fork the sandboxes' runners."""
        zygote = self.launcher.client.pid
        found = []
        for entry in Path("/proc").iterdir():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except (OSError, ValueError):
                continue
            if entry.name.isdigit() and int(stat[stat.rfind(")") + 2:].split()[1]) == zygote \
                    and b"\0--template\0" in cmdline:
                found.append(int(entry.name))
        return found

    def stats(self) -> dict[str, Any]:
        return self.run(self.launcher.client.stats())

    def close(self) -> None:
        for sandbox in list(self.live):
            try:
                self.kill(sandbox)
            except Exception:  # noqa: BLE001 - best effort; the zygote's close kills the rest
                pass
        self.run(self.launcher.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        shutil.rmtree(self.base, ignore_errors=True)
