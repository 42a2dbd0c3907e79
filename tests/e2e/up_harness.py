"""`sandpool up` in a subprocess for the end-to-end tests, and what they check after it stops."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
from testkit import descendants, free_port, survivors, wait_for


class Up:
    """`sandpool up` in a subprocess, its stdout lines collected by a thread."""

    def __init__(self, *args: str, data_dir: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="spu"))
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.stderr = open(self.data_dir.parent / f"{self.data_dir.name}.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandpool", "up", "--port", str(self.port), "--data-dir", str(self.data_dir),
             "--pool-size", "2", "--max-sandboxes", "6", "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=self.stderr, start_new_session=True,
            env={**os.environ, **env} if env else None)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode().rstrip("\n"))

    def printed(self, prefix: str, timeout: float = 60) -> str:
        """What follows `prefix` on the first stdout line that starts with it, waiting up to `timeout`;
        an up that exits without printing it fails at once."""
        def found() -> list[str]:
            values = [line[len(prefix):] for line in self.lines if line.startswith(prefix)]
            if not values and self.proc.poll() is not None:
                raise AssertionError(f"up exited with {self.proc.returncode} and no {prefix} line; "
                                     f"stdout={self.lines}; stderr tail={self.log_tail()}")
            return values

        return wait_for(found, timeout=timeout, what=f"a {prefix} line",
                        state=lambda: f"stdout={self.lines}; stderr tail={self.log_tail()}")[0]

    def log_tail(self) -> str:
        self.stderr.flush()
        return (self.data_dir.parent / f"{self.data_dir.name}.log").read_text(errors="replace")[-3000:]

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, set[int]]:
        """Signal up; return its exit code and every process of its tree seen just before."""
        tree = descendants(self.proc.pid)
        self.proc.send_signal(sig)
        code = self.proc.wait(60)
        return code, tree

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.stderr.close()
        (self.data_dir.parent / f"{self.data_dir.name}.log").unlink(missing_ok=True)
        # A killed up could not remove its socket directory; the note of it is in the data dir.
        with contextlib.suppress(OSError):
            sockets = Path((self.data_dir / "run" / "sockets-dir").read_text().strip())
            if sockets.name.startswith("sandpool-up-"):
                shutil.rmtree(sockets, ignore_errors=True)
        # Nor its sandboxes' socket directory (providers/local/sockets.py), which the data dir names too.
        with contextlib.suppress(OSError):
            agent_sockets = Path((self.data_dir / "sockets").read_text().strip())
            if agent_sockets.is_absolute() and agent_sockets.name.startswith("sp-"):
                shutil.rmtree(agent_sockets, ignore_errors=True)
        shutil.rmtree(self.data_dir, ignore_errors=True)


def exec_code(client: httpx.Client, session: str, code: str) -> dict:
    response = client.post(f"/sessions/{session}/exec", json={"tool": "code_execution", "input": {"code": code}})
    assert response.status_code == 200, response.text
    return response.json()["result_block"]["content"]


def assert_stopped_clean(up: Up, sig: int = signal.SIGTERM) -> None:
    code, tree = up.stop(sig)
    assert code == 0, up.log_tail()
    assert tree, "the stack had no processes?"
    left = survivors(tree, timeout=10)
    assert left == [], f"processes survived sandpool up: {left}"
    sandboxes = up.data_dir / "sandboxes"
    assert not sandboxes.exists() or list(sandboxes.iterdir()) == []


def json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # (redis-server's own lines are not JSON)
    return out
