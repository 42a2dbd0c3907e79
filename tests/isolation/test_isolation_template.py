"""The shared part of every sandbox root (the zygote's template mount namespace) carries nothing from one
sandbox to the next.

The zygote builds the read-only part of the root once (isolation/mounts.py: prepare_template) and every
sandbox starts from a copy of it: the root tmpfs, /dev and the /etc masks are the same superblocks in
every sandbox. So one sandbox plants what it can (files wherever it may write or try to, a listening
socket, a background process) and a later sandbox of the same zygote looks for all of it: the shared
superblocks must be read-only (writes fail with EROFS, not merely EACCES, so neither the code's uid nor
the agent's root could write there), and the sandbox's own mounts must be new ones.
"""

from __future__ import annotations

import errno
import json
from typing import Any

import pytest

from .harness import Harness, Sandbox

pytestmark = pytest.mark.isolation

SHARED = ("/", "/dev", "/etc/ssh")  # from the template (/etc/ssh: a mask, where this host has one)
OWN = ("/tmp", "/dev/shm", "/workspace", "/proc")

LOOK = """
import json, os, socket, subprocess
mounts = {}
for line in open("/proc/self/mountinfo"):
    left, _, right = line.partition(" - ")
    parts, rparts = left.split(), right.split()
    mounts[parts[4]] = {"dev": parts[2], "super": rparts[2].split(",")}
found = {p: os.path.exists(p) for p in ("/tmp/marker", "/dev/shm/marker", "/workspace/marker", "/tmp/marker.sock")}
procs = sorted(open(f"/proc/{p}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
               for p in os.listdir("/proc") if p.isdigit())
print(json.dumps({"mounts": mounts, "found": found, "procs": procs, "root": sorted(os.listdir("/")),
                  "dev": sorted(os.listdir("/dev")), "run": sorted(os.listdir("/run"))}))
"""

PLANT = """
import errno, os, socket, subprocess
attempts = {}
for path in ("/marker", "/dev/marker", "/etc/ssh/marker", "/run/marker", "/usr/marker", "/.empty"):
    try:
        with open(path, "w") as f:
            f.write("planted")
        attempts[path] = "written"
    except OSError as exc:
        attempts[path] = exc.errno
for path in ("/tmp/marker", "/dev/shm/marker", "/workspace/marker"):
    with open(path, "w") as f:
        f.write("planted")
listener = socket.socket(socket.AF_UNIX)
listener.bind("/tmp/marker.sock")
listener.listen()
subprocess.Popen(["sleep", "600"], start_new_session=True)
globals()["kept"] = listener
print(__import__("json").dumps(attempts))
"""


def _look(sandbox: Sandbox) -> dict[str, Any]:
    out = sandbox.python(LOOK)
    assert out["return_code"] == 0, out["stderr"]
    return json.loads(out["stdout"])


def test_nothing_one_sandbox_plants_reaches_the_next(harness: Harness) -> None:
    first = harness.start()
    before = _look(first)
    out = first.python(PLANT)
    assert out["return_code"] == 0, out["stderr"]
    attempts = json.loads(out["stdout"])
    # Read-only at the mount, not just forbidden to this uid: EROFS is what the agent's root would get too.
    assert all(attempts[p] == errno.EROFS for p in ("/marker", "/dev/marker", "/run/marker", "/.empty")), attempts
    assert all(result != "written" for result in attempts.values()), attempts
    planted = _look(first)
    assert all(planted["found"].values()), planted["found"]
    assert any(p.startswith("sleep 600") for p in planted["procs"]), planted["procs"]

    beside = harness.start()  # while the first still runs: its mounts cannot have been freed and reused
    alongside = _look(beside)
    harness.kill(beside)
    harness.kill(first)
    later = harness.start()
    after = _look(later)
    harness.kill(later)
    for view in (alongside, after):
        assert not any(view["found"].values()), view["found"]
        assert not any(p.startswith("sleep 600") for p in view["procs"]), view["procs"]
        assert (view["root"], view["dev"], view["run"]) == (before["root"], before["dev"], before["run"])
        assert set(view["mounts"]) == set(before["mounts"])  # no mount planted, none lost
        for point in SHARED:
            if point not in before["mounts"]:
                continue
            # The very same superblock (this is what is reused), read-only in the kernel's super options.
            assert view["mounts"][point]["dev"] == before["mounts"][point]["dev"], point
            assert "ro" in view["mounts"][point]["super"], (point, view["mounts"][point])
    for point in OWN:
        # Superblocks of its own (compared while both live: a freed one's number is reused).
        assert alongside["mounts"][point]["dev"] != planted["mounts"][point]["dev"], point


def test_a_workspace_mounted_on_the_host_after_the_template_is_the_one_the_sandbox_sees(harness: Harness) -> None:
    """A provider mounts each sandbox's size-capped workspace on the host; the template namespace was
    copied before that mount existed, so the sandbox must get the host's mount, not the directory under it."""
    sandbox = harness.start(host_tmpfs=True, workspace_mb=4)
    (sandbox.workspace / "from-host").write_text("host side")
    out = sandbox.python("import os\nprint(open('/workspace/from-host').read())\n"
                         "st = os.statvfs('/workspace'); print(st.f_blocks * st.f_frsize)\n"
                         "open('/workspace/from-sandbox', 'w').write('sandbox side')")
    assert out["return_code"] == 0, out["stderr"]
    text, size = out["stdout"].splitlines()
    assert text == "host side"
    assert int(size) == 4 * 1024 * 1024  # the host's capped tmpfs
    assert (sandbox.workspace / "from-sandbox").read_text() == "sandbox side"
    harness.kill(sandbox)
