"""Privilege drop: as root with --sandbox-uid, sandboxed code runs unprivileged and cannot read the secret."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from agent_harness import S, content, start_agent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")

RUNNER = Path(__file__).resolve().parents[2] / "services/sandpool/agent/runner.py"


def python_for_nobody() -> str | None:
    """A Python the sandbox uid may run, that can also read the runner (a root-only pyenv cannot)."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not candidate:
            continue
        try:
            probe = subprocess.run([candidate, "-I", "-c", f"open({str(RUNNER)!r}).read()"], user=65534,
                                   group=65534, extra_groups=[], capture_output=True, timeout=30, cwd="/")
        except OSError:
            continue
        if probe.returncode == 0:
            return candidate
    return None


def test_children_drop_to_the_sandbox_uid(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("dropped-secret")
    secret_file.chmod(0o600)
    tmp_path.chmod(0o755)
    python = python_for_nobody()
    if python is None:
        pytest.skip("no Python (and runner) readable by uid 65534 on this host")
    a = start_agent(tmp_path, "--python-executable", python, "--sandbox-uid", "65534", "--sandbox-gid", "65534",
                    "--secret-file", str(secret_file), secret="unused")
    a.client.headers["Authorization"] = "Bearer dropped-secret"
    try:
        ids = content(a.py("import os\nprint(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())"))
        assert ids["stdout"] == "65534 65534 65534 []\n"
        assert content(a.sh("id -u; id -g"))["stdout"] == "65534\n65534\n"
        nnp = content(a.sh("grep NoNewPrivs /proc/self/status"))["stdout"]
        assert nnp.split() == ["NoNewPrivs:", "1"]
        assert content(a.sh("ulimit -c"))["stdout"] == "0\n"
        # The secret: not in the file (unreadable), not in the agent's environment or memory (undumpable).
        leak = content(a.sh(f"cat {secret_file}; cat /proc/{a.proc.pid}/environ; echo done"))
        assert "dropped-secret" not in leak["stdout"] and leak["stdout"].endswith("done\n")
        # The workspace is the sandbox's own, and uploads are writable by it.
        assert (a.workspace.stat().st_uid, a.workspace.stat().st_gid) == (65534, 65534)
        put = a.client.post(f"{S}/files", files={"file": ("f", b"seed")}, data={"path": "in/seed.txt"})
        assert put.status_code == 201
        assert (a.workspace / "in/seed.txt").stat().st_uid == 65534
        assert content(a.sh("echo more >> in/seed.txt && echo ok"))["stdout"] == "ok\n"
        edit = content(a.edit("create", "made.txt", file_text="x"))
        assert edit["return_code"] == 0 and (a.workspace / "made.txt").stat().st_uid == 65534
    finally:
        a.stop()
