"""A real `sandpool up --no-auth` in a subprocess, for the client's end-to-end tests.

It waits for `SANDPOOL_URL=` on the stack's stdout (printed once the pool is
warm) and keeps the stack's stderr in a file so a failure shows its logs.
The stack runs in its own process group so teardown also ends whatever it
started (redis-server, sandbox agents) should it not stop them itself.
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
from pathlib import Path

from testkit import scrubbed_env

STARTUP_SECONDS = 40.0


class StackUnavailable(Exception):
    """`sandpool up` is not there to start (not built yet, or not installed)."""


def up_help() -> str:
    proc = subprocess.run([sys.executable, "-m", "sandpool", "up", "--help"], capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0 or "--no-auth" not in proc.stdout:
        said = " ".join((proc.stdout + proc.stderr).split())[:200]
        raise StackUnavailable(f"`sandpool up --no-auth` is not available in this tree yet "
                               f"(`sandpool up --help` exit {proc.returncode}: {said!r})")
    return proc.stdout


class Stack:
    def __init__(self, port: int, extra_args: list[str], *, auth: bool = False,
                 env: dict[str, str] | None = None, data_dir: Path | None = None) -> None:
        self.port = port
        self.extra_env = dict(env or {})
        # Sandboxes run as other uids and must traverse every parent of the data dir, so it
        # lives directly under /tmp (pytest's own tmp dirs are 0700), searchable, not listable.
        self.owns_data_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="spclient", dir="/tmp"))
        self.args = [sys.executable, "-m", "sandpool", "up", *([] if auth else ["--no-auth"]), "--port", str(port),
                     "--data-dir", str(self.data_dir), *extra_args]
        self.auth = auth
        self.stderr_path = self.data_dir.parent / f"{self.data_dir.name}-stderr.log"
        self.proc: subprocess.Popen[str] | None = None
        self.env: dict[str, str] = {}
        self.stdout_lines: list[str] = []
        self.limits: dict[str, int] = {}
        """The limits the stack was started with (`max_sandboxes`, `max_body_bytes`), when `up` takes them."""

    @classmethod
    def external(cls, url: str, *, token: str | None, limits: dict[str, int]) -> Stack:
        """A stack already running elsewhere: nothing to start or stop."""
        stack = cls(0, [], data_dir=Path("/nonexistent"))
        stack.env = {"SANDPOOL_URL": url, **({"SANDPOOL_TOKEN": token} if token else {})}
        stack.limits = limits
        return stack

    @property
    def url(self) -> str:
        return self.env["SANDPOOL_URL"]

    @property
    def token(self) -> str | None:
        return self.env.get("SANDPOOL_TOKEN")

    def logs(self, last: int = 60) -> str:
        try:
            lines = self.stderr_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-last:])

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.owns_data_dir:
            self.data_dir.chmod(0o711)
        stderr = self.stderr_path.open("w")
        env = scrubbed_env(**self.extra_env)
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                                     start_new_session=True)
        stderr.close()
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + STARTUP_SECONDS
        wanted = ("SANDPOOL_URL", "SANDPOOL_TOKEN") if self.auth else ("SANDPOOL_URL",)
        while not all(k in self.env for k in wanted):
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                code = self.proc.poll()
                why = "exited" if code is not None else f"printed no {' and '.join(wanted)} in {STARTUP_SECONDS:g}s"
                self.stop()
                raise RuntimeError(f"sandpool up {why} (rc={code}); stderr:\n{self.logs()}")
            self.stdout_lines.append(line)
            key, sep, value = line.strip().partition("=")
            if sep and key.startswith("SANDPOOL_"):
                self.env[key] = value

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        try:  # anything of its group it left behind
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        # Sandboxes that left the group (a new session) but live under our data dir are ours too.
        for pid in self.leftovers():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for mountpoint in self.mounts():  # e.g. size-capped workspaces of sandboxes it did not destroy
            subprocess.run(["umount", "-l", mountpoint], capture_output=True, timeout=10)
        self.proc = None

    def remove(self) -> None:
        """Delete the data directory and the log (after `stop`)."""
        if self.owns_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.stderr_path.unlink(missing_ok=True)

    def mounts(self) -> list[str]:
        """Mount points under this stack's data directory, deepest first."""
        prefix = str(self.data_dir) + "/"
        try:
            lines = Path("/proc/self/mounts").read_text().splitlines()
        except OSError:
            return []
        points = [line.split()[1] for line in lines if len(line.split()) > 1]
        return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)

    def leftovers(self) -> list[int]:
        """Processes still running whose command line names this stack's data directory."""
        marker = str(self.data_dir).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if marker in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
        return found
