"""Real agent processes (`python -m sandpool agent`) on a Unix socket or loopback TCP, and httpx clients."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    def __init__(self, proc: subprocess.Popen[bytes], base_url: str, transport_kwargs: dict[str, Any],
                 workspace: Path, secret: str, log_path: Path) -> None:
        self.proc = proc
        self.base_url = base_url
        self.transport_kwargs = transport_kwargs
        self.workspace = workspace
        self.secret = secret
        self.log_path = log_path
        self.client = self.new_client(secret)

    def new_client(self, secret: str | None, timeout: float = 60.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                            transport=httpx.HTTPTransport(**self.transport_kwargs))

    def exec(self, tool: str, *, timeout: int | None = None, tool_use_id: str | None = None,
             **fields: Any) -> httpx.Response:
        body: dict[str, Any] = {"tool": tool, "input": fields}
        if timeout is not None:
            body["timeout_seconds"] = timeout
        if tool_use_id is not None:
            body["tool_use_id"] = tool_use_id
        return self.client.post("/sessions/s1/exec", json=body)

    def py(self, code: str, **kw: Any) -> dict[str, Any]:
        resp = self.exec("code_execution", code=code, **kw)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def sh(self, command: str, **kw: Any) -> dict[str, Any]:
        resp = self.exec("bash_code_execution", command=command, **kw)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def edit(self, command: str, path: str, **kw: Any) -> dict[str, Any]:
        resp = self.exec("text_editor_code_execution", command=command, path=path, **kw)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return self.proc.returncode


def start_agent(tmp: Path, *args: str, uds: bool = True, env: dict[str, str] | None = None,
                secret: str | None = None, wait: bool = True) -> Agent:
    workspace = tmp / "workspace"
    workspace.mkdir(parents=True, exist_ok=True)
    secret = secret or secrets.token_hex(16)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SANDPOOL_")}
    full_env["SANDPOOL_AGENT_SECRET"] = secret
    full_env.update(env or {})
    log_path = tmp / "agent.log"
    if uds:
        sock = tmp / "agent.sock"
        where = ["--uds", str(sock)]
        base_url, transport_kwargs = "http://agent", {"uds": str(sock)}
    else:
        port = free_port()
        where = ["--host", "127.0.0.1", "--port", str(port)]
        base_url, transport_kwargs = f"http://127.0.0.1:{port}", {}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "sandpool", "agent", *where, "--workspace", str(workspace),
                                 *args], env=full_env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO))
    agent = Agent(proc, base_url, transport_kwargs, workspace, secret, log_path)
    if wait:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"agent exited with {proc.returncode}:\n{agent.logs()}")
            try:
                if agent.client.get("/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                agent.stop()
                raise RuntimeError(f"agent did not answer /healthz:\n{agent.logs()}")
            time.sleep(0.02)
    return agent


def content(result: dict[str, Any]) -> dict[str, Any]:
    return result["result_block"]["content"]


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def wait_dead(pids: list[int], timeout: float = 5.0) -> list[int]:
    """The pids still alive after polling up to `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if pid_alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)
