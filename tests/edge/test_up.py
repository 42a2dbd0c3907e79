"""`sandpool up` with a trusted key of the test's own: the whole stack, authenticated, over HTTP.

Its topology: Redis, `sandpool controller` (pools, reaper, provider) on a Unix
socket in a private directory, and `sandpool api` (the edge over the session
layer) on the public port; an api that dies is started again, and the sessions
it served live on (their state is in Redis, their sandboxes the controller's).
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from testkit import descendants, free_port, scrubbed_env, wait_for

from .conftest import Keys

STARTUP_SECONDS = 60.0
PRINT_1 = {"tool": "code_execution", "input": {"code": "print(1)"}}


@dataclass
class Up:
    printed: dict[str, str]
    proc: subprocess.Popen[str]
    stderr: Path

    @property
    def url(self) -> str:
        return self.printed["SANDPOOL_URL"]

    def child(self, command: str) -> tuple[int, list[str]]:
        """The pid and argv of the one `sandpool <command>` process up runs."""
        found = []
        for pid in descendants(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
            except OSError:
                continue
            if argv[1:4] == ["-m", "sandpool", command]:
                found.append((pid, argv))
        assert len(found) == 1, (command, found)
        return found[0]


@pytest.fixture
def up(keys: Keys) -> Iterator[Up]:
    data_dir = Path(tempfile.mkdtemp(prefix="spu-", dir="/tmp"))  # short: agent socket paths live here
    stderr_path = data_dir.parent / f"{data_dir.name}.log"
    env = scrubbed_env()
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandpool", "up", "--port", str(free_port()), "--data-dir", str(data_dir),
             "--auth-public-key", str(keys.public)],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    printed: dict[str, str] = {}
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while "SANDPOOL_URL" not in printed:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"sandpool up printed no SANDPOOL_URL: {stderr_path.read_text()[-3000:]}")
            key, sep, value = line.strip().partition("=")
            if sep and key.startswith("SANDPOOL_"):
                printed[key] = value
        # The token line follows the URL line.
        try:
            line = lines.get(timeout=5)
            key, sep, value = (line or "").strip().partition("=")
            if sep and key == "SANDPOOL_TOKEN":
                printed[key] = value
        except queue.Empty:
            pass
        yield Up(printed, proc, stderr_path)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of its group it left behind
        except (ProcessLookupError, PermissionError):
            pass
        shutil.rmtree(data_dir, ignore_errors=True)  # its sandboxes were destroyed by the stop
        stderr_path.unlink(missing_ok=True)


def test_up_serves_authenticated_sessions_with_our_key(up: Up, keys: Keys, other_keys: Keys) -> None:
    url = up.url
    with httpx.Client(base_url=url, timeout=60,
                      headers={"Authorization": f"Bearer {keys.token('e2e')}"}) as client:
        created = client.post("/sessions", json={})
        assert created.status_code == 201, created.text
        sid = created.json()["session_id"]
        result = client.post(f"/sessions/{sid}/exec", json=PRINT_1).json()
        assert result["result_block"]["content"]["stdout"] == "1\n"
        assert client.delete(f"/sessions/{sid}").status_code == 204
        assert client.get("/v1/usage").json()["total"]["sessions_created"] == 1
    untrusted = httpx.post(f"{url}/sessions", json={}, timeout=30,
                           headers={"Authorization": f"Bearer {other_keys.token('e2e')}"})
    assert untrusted.status_code == 401 and untrusted.headers["www-authenticate"] == "Bearer"
    assert httpx.post(f"{url}/sessions", json={}, timeout=30).status_code == 401
    assert "SANDPOOL_TOKEN" not in up.printed  # our key: up has no private key to mint with


def test_up_runs_a_controller_on_a_private_socket_and_the_api_on_the_public_port(up: Up) -> None:
    _, controller = up.child("controller")
    _, api = up.child("api")
    socket_path = Path(controller[controller.index("--unix-socket") + 1])
    assert stat.S_ISSOCK(socket_path.stat().st_mode) and stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
    assert "--port" not in controller and "--data-dir" in controller  # the provider is the controller's
    assert api[api.index("--port") + 1] == up.url.rsplit(":", 1)[1] and "--auth-public-key" in api
    assert "--data-dir" not in api
    assert httpx.get(f"{up.url}/readyz", timeout=10).json() == {"status": "ready", "checks": {"redis": "ok"}}
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path)), base_url="http://controller",
                      timeout=10) as controller_client:
        ready = controller_client.get("/readyz").json()
        assert ready["status"] == "ready" and ready["checks"]["controller"] == "leader", ready
        assert "sandpool_pool_sandboxes" in controller_client.get("/metrics").text
    assert "sandpool_pool_sandboxes" not in httpx.get(f"{up.url}/metrics", timeout=10).text


def test_an_api_that_dies_is_started_again_and_its_sessions_live_on(up: Up, keys: Keys) -> None:
    headers = {"Authorization": f"Bearer {keys.token('e2e')}"}
    with httpx.Client(base_url=up.url, timeout=60, headers=headers) as client:
        sid = client.post("/sessions", json={}).json()["session_id"]
        assert client.post(f"/sessions/{sid}/exec", json={
            "tool": "bash_code_execution", "input": {"command": "echo kept > note.txt"}}).status_code == 200
    pid, _ = up.child("api")
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: "the api exited (killed by SIGKILL); starting it again in" in up.stderr.read_text(),
             timeout=30, what="up noticing the api died")

    def serving() -> bool:
        try:
            return httpx.get(f"{up.url}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(serving, timeout=60, what="the api started again")
    assert up.child("api")[0] != pid and up.proc.poll() is None
    with httpx.Client(base_url=up.url, timeout=60, headers=headers) as client:
        assert client.get(f"/sessions/{sid}/files", params={"path": "note.txt"}).content == b"kept\n"
        assert client.post(f"/sessions/{sid}/exec", json=PRINT_1).json()["result_block"]["content"]["stdout"] == "1\n"
        assert client.delete(f"/sessions/{sid}").status_code == 204
