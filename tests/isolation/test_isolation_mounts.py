"""The sandbox root keeps read-only views of paths under /tmp (sandpool installed there, as a CI checkout is).

Regression: the sandbox's own /tmp tmpfs was mounted after the read-only binds and hid
every bound path under /tmp, so a sandpool checkout or venv under /tmp had no agent
runner inside its sandboxes and no sandbox ever became ready.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.isolation

PROBE = textwrap.dedent("""
    import os, sys
    from sandpool.providers.local.isolation import mounts
    src, new_root = sys.argv[1], sys.argv[2]
    plan = mounts.plan_root((src,))
    fs = mounts.SandboxFs(uid=65534, gid=65534, workspace_source=None, workspace_bytes=1 << 20,
                          tmp_bytes=1 << 20, shm_bytes=1 << 20, agent_dir=None)
    mounts.build_root(plan, fs, new_root)
    print(open(os.path.join(src, "marker.txt")).read())
    print("tmp-writable", os.access("/tmp", os.W_OK))
    print("tmp-entries", sorted(os.listdir("/tmp")))
    print("tmp-binds", sorted({b.split("/")[2] for b in plan.binds if b.startswith("/tmp/")}))
""")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs util-linux unshare")
def test_paths_under_tmp_stay_visible_and_read_only_inside_the_sandbox_root() -> None:
    base = Path(tempfile.mkdtemp(prefix="spmnt", dir="/tmp"))
    try:
        src = base / "checkout"
        src.mkdir()
        (src / "marker.txt").write_text("visible")
        new_root = base / "root"
        new_root.mkdir()
        out = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c", PROBE,
                              str(src), str(new_root)], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr[-2000:]
        lines = out.stdout.splitlines()
        assert lines[0] == "visible"
        assert lines[1] == "tmp-writable True"
        # Only the paths leading to what is bound show in the sandbox's /tmp (this checkout, and
        # sandpool's own checkout or venv when they live under /tmp too): not the host's other
        # /tmp entries (other sandboxes' harness dirs, the data dir, sockets).
        bound_under_tmp = set(ast.literal_eval(lines[3].removeprefix("tmp-binds ")))
        assert base.name in bound_under_tmp
        assert lines[2] == f"tmp-entries {sorted(bound_under_tmp)}"
    finally:
        shutil.rmtree(base, ignore_errors=True)
