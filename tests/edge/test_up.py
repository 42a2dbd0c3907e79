"""`sandpool up` with a trusted key of the test's own: the whole stack, authenticated, over HTTP.

Skipped until `sandpool up` exists and takes `--auth-public-key`.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from testkit import free_port, scrubbed_env

from .conftest import Keys

STARTUP_SECONDS = 60.0
PRINT_1 = {"tool": "code_execution", "input": {"code": "print(1)"}}


def _up_takes_a_key() -> bool:
    try:
        proc = subprocess.run([sys.executable, "-m", "sandpool", "up", "--help"], capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0 and "--auth-public-key" in proc.stdout


@pytest.fixture(scope="module")
def up_available() -> None:
    if not _up_takes_a_key():
        pytest.skip("`sandpool up --auth-public-key` is not in this tree yet")


@pytest.fixture
def up(up_available: None, keys: Keys) -> Iterator[dict[str, str]]:
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
        yield printed
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


def test_up_serves_authenticated_sessions_with_our_key(up: dict[str, str], keys: Keys, other_keys: Keys) -> None:
    url = up["SANDPOOL_URL"]
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
    if "SANDPOOL_TOKEN" in up:
        printed = httpx.post(f"{url}/sessions", json={}, timeout=30,
                             headers={"Authorization": f"Bearer {up['SANDPOOL_TOKEN']}"})
        assert printed.status_code == 201, printed.text
