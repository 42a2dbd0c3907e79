"""Hostile code in a real zygote-launched sandbox tries to get out, and must not.

Every test runs code through the agent's HTTP API over its Unix socket, like the
scheduler does, and checks from the host side as well where it can (a listener
that must see no connection, a marker file that must stay unseen).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest
from testkit import alive

import sandpool

from .harness import Harness

pytestmark = pytest.mark.isolation


def _status(sandbox, field: str) -> str:
    out = sandbox.python(f"print([l.split(':',1)[1].strip() for l in open('/proc/self/status') "
                         f"if l.startswith('{field}:')][0])")
    return out["stdout"].strip()


def test_every_layer_is_active_on_this_host(harness: Harness) -> None:
    # CI's host is root in a VM with namespaces, cgroup v1 and seccomp: nothing may be missing.
    assert harness.report.missing == [], harness.report.warning()
    assert harness.launcher.describe()["namespaces"] is True


def test_code_runs_unprivileged_without_capabilities(harness: Harness) -> None:
    sandbox = harness.start()
    out = sandbox.python("import os; print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())")
    assert out["stdout"].split() == [str(sandbox.uid), str(sandbox.uid), str(sandbox.uid), "[]"]
    assert int(_status(sandbox, "CapEff"), 16) == 0
    assert int(_status(sandbox, "CapPrm"), 16) == 0
    assert _status(sandbox, "NoNewPrivs") == "1"
    assert _status(sandbox, "Seccomp") == "2"
    # bash children too.
    out = sandbox.bash("grep -E '^(CapEff|NoNewPrivs|Seccomp):' /proc/self/status; id -u")
    lines = dict(line.split(":\t") for line in out["stdout"].strip().splitlines()[:3])
    assert lines == {"CapEff": "0000000000000000", "NoNewPrivs": "1", "Seccomp": "2"}
    assert out["stdout"].strip().splitlines()[-1] == str(sandbox.uid)
    harness.kill(sandbox)


def test_seccomp_refuses_namespace_and_mount_calls(harness: Harness) -> None:
    sandbox = harness.start()
    out = sandbox.python(
        "import ctypes, errno, json\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "res = {}\n"
        "for name, call in [('unshare', lambda: libc.unshare(0x10000000)),\n"
        "                   ('mount', lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)),\n"
        "                   ('ptrace', lambda: libc.ptrace(16, 1, 0, 0)),\n"
        "                   ('bpf', lambda: libc.syscall(321, 0, 0, 0)),\n"
        "                   ('clone_newuser', lambda: libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)),\n"
        "                   ('keyctl', lambda: libc.syscall(250, 0, 0, 0, 0))]:\n"
        "    r = call(); res[name] = (r, errno.errorcode.get(ctypes.get_errno()))\n"
        "print(json.dumps(res))")
    res = json.loads(out["stdout"])
    assert all(r == [-1, "EPERM"] for r in res.values()), res
    harness.kill(sandbox)


def test_no_network_at_all(harness: Harness, redis_server) -> None:
    # A real TCP listener on the host's loopback standing in for the scheduler's port.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    sandbox = harness.start()
    try:
        port = listener.getsockname()[1]
        out = sandbox.python(
            "import socket, json\n"
            "res = {}\n"
            f"for name, addr in [('scheduler', ('127.0.0.1', {port})), ('redis', ('127.0.0.1', {redis_server.port})),\n"
            "                    ('internet', ('1.1.1.1', 53)), ('metadata', ('169.254.169.254', 80))]:\n"
            "    s = socket.socket(); s.settimeout(2)\n"
            "    try:\n"
            "        s.connect(addr); res[name] = 'connected'\n"
            "    except OSError as e:\n"
            "        res[name] = type(e).__name__\n"
            "    finally:\n"
            "        s.close()\n"
            "import os; res['ifaces'] = sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') "
            "else [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]\n"
            "print(json.dumps(res))")
        res = json.loads(out["stdout"])
        assert res["scheduler"] != "connected" and res["redis"] != "connected", res
        assert res["internet"] != "connected" and res["metadata"] != "connected", res
        assert res["ifaces"] == ["lo"]
        assert accepted == []
        # The same probe from the host does reach the listener: the test can fail.
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        stop.set()
        thread.join(2)
        listener.close()
        harness.kill(sandbox)


def test_host_files_data_dir_and_redis_are_out_of_sight(harness: Harness, redis_server) -> None:
    marker = harness.base / "service-secret.txt"
    marker.write_text("host-only")
    redis_marker = Path(redis_server.data_dir) / "marker.rdb"
    redis_marker.write_text("redis-only")
    sandbox = harness.start()
    paths = [str(marker), str(redis_marker), str(harness.sandboxes_dir), str(sandbox.directory / "secret"),
             "/home", "/var/lib", "/run/sandpool/../secret", "/sys/fs/cgroup", "/root/.ssh"]
    out = sandbox.python(
        "import os, json\n"
        f"print(json.dumps({{p: os.path.exists(p) for p in {paths!r}}}))")
    seen = json.loads(out["stdout"])
    assert not any(seen.values()), seen
    # On the way to the Python installation (pyenv puts it in /root) only what leads to the
    # bound read-only trees is visible: the Python prefix and sandpool's own source.
    package_root = str(Path(sandpool.__file__).resolve().parent.parent)
    out = sandbox.python(
        "import os, sys, json\n"
        f"targets = [sys.prefix, sys.base_prefix, {package_root!r}]\n"
        "seen = {}\n"
        "for target in targets:\n"
        "    parts = target.strip('/').split('/')\n"
        "    for i in range(1, len(parts)):\n"
        "        d = '/' + '/'.join(parts[:i])\n"
        "        seen[d] = sorted(os.listdir(d))\n"
        "print(json.dumps({'seen': seen, 'targets': targets, 'own': os.environ.get('MPLCONFIGDIR', '')}))")
    report = json.loads(out["stdout"])
    # The sandbox's own matplotlib directory sits in its private /tmp (where a checkout under
    # /tmp is also on the way to the bound trees): the sandbox's, not the host's.
    targets = [*report["targets"], report["own"]] if report["own"] else report["targets"]
    for directory, listing in report["seen"].items():
        leading = {t[len(directory) + 1:].split("/")[0] for t in targets if t.startswith(directory + "/")}
        assert set(listing) <= leading, (directory, listing, leading)
    out = sandbox.python(
        "import os, json\n"
        "res = {'shadow': open('/etc/shadow').read(), 'root': sorted(os.listdir('/'))}\n"
        "for path in ['/usr/evil', '/etc/evil', '/evil']:\n"
        "    try:\n"
        "        open(path, 'w'); res[path] = 'written'\n"
        "    except OSError as e:\n"
        "        res[path] = e.errno\n"
        "print(json.dumps(res))")
    res = json.loads(out["stdout"])
    assert res["shadow"] == ""
    assert all(res[p] != "written" for p in ("/usr/evil", "/etc/evil", "/evil")), res
    assert "work" not in res["root"] or res["root"].count("work") == 1
    assert {"home", "var", "sys", "boot"}.isdisjoint(res["root"]), res["root"]
    harness.kill(sandbox)


def test_sandboxes_cannot_see_each_other(harness: Harness) -> None:
    a = harness.start()
    b = harness.start()
    try:
        a.python("open('/workspace/a-private.txt', 'w').write('mine')\nimport time")
        a.bash("sleep 300 & echo started")
        out = b.python(
            "import os, json, socket\n"
            f"paths = ['/workspace/a-private.txt', {str(a.workspace)!r}, {str(a.socket_path)!r}, "
            f"{str(a.directory)!r}]\n"
            "res = {'exists': [os.path.exists(p) for p in paths]}\n"
            "res['pids'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "res['cmds'] = [open(f'/proc/{p}/cmdline','rb').read().split(b'\\0')[0].decode() for p in res['pids']]\n"
            "s = socket.socket(socket.AF_UNIX)\n"
            "try:\n"
            f"    s.connect({str(a.socket_path)!r}); res['agent'] = 'connected'\n"
            "except OSError as e:\n"
            "    res['agent'] = type(e).__name__\n"
            "print(json.dumps(res))")
        res = json.loads(out["stdout"])
        assert res["exists"] == [False, False, False, False]
        assert res["agent"] != "connected"
        assert not any("sleep" in c for c in res["cmds"]), res["cmds"]
        assert res["pids"][0] == 1 and max(res["pids"]) < 100, res["pids"]  # its own small PID namespace
        # a's sleeper really exists (in a's namespace): the check above can fail.
        assert "sleep" in a.bash("ps -eo comm")["stdout"]
        # The IPC namespace is private too: a SysV segment made in a is not visible in b.
        a.python("import ctypes; libc = ctypes.CDLL(None); print(libc.shmget(0x5A4D, 4096, 0o1666))")
        out = b.python("import ctypes; libc = ctypes.CDLL(None); print(libc.shmget(0x5A4D, 4096, 0o666))")
        assert out["stdout"].strip() == "-1"
    finally:
        harness.kill(a)
        harness.kill(b)


def test_agent_secret_is_unreadable_by_sandboxed_code(harness: Harness) -> None:
    sandbox = harness.start()
    try:
        out = sandbox.python(
            "import os, json, gc\n"
            f"secret = {sandbox.secret[:8]!r}\n"  # a prefix: the full value never enters the sandbox
            "res = {}\n"
            "for p in ['/proc/1/environ', '/proc/1/mem', '/proc/1/maps', '/proc/self/environ', '/proc/1/cmdline']:\n"
            "    try:\n"
            "        data = open(p, 'rb').read(1 << 20); res[p] = secret.encode() in data\n"
            "    except OSError as e:\n"
            "        res[p] = type(e).__name__\n"
            "hits = []\n"
            "for top in ['/run', '/workspace', '/tmp', '/dev/shm', '/etc']:\n"
            "    for root, dirs, files in os.walk(top):\n"
            "        for f in files:\n"
            "            try:\n"
            "                if secret.encode() in open(os.path.join(root, f), 'rb').read(1 << 20): hits.append(f)\n"
            "            except OSError:\n"
            "                pass\n"
            "res['files'] = hits\n"
            "res['env'] = any(secret in v for v in os.environ.values())\n"
            "res['heap'] = sum(1 for o in gc.get_objects() if isinstance(o, str) and o.startswith(secret) "
            "and o is not secret)\n"
            "print(json.dumps(res))")
        assert out["return_code"] == 0 and out["stdout"], out  # (once seen empty in a loaded suite run)
        res = json.loads(out["stdout"])
        assert res["/proc/1/environ"] in ("PermissionError", False)
        assert res["/proc/1/mem"] == "PermissionError"
        assert res["/proc/self/environ"] is False and res["/proc/1/cmdline"] is False
        assert res["files"] == [] and res["env"] is False and res["heap"] == 0, res
        # The agent does hold it: a call without it is refused, with it accepted.
        assert sandbox.client.post("/sessions/s/exec", json={}).status_code == 401
    finally:  # a failure here must not leave its sandbox to the next tests of the shared harness
        harness.kill(sandbox)


def test_fork_bomb_is_contained(harness: Harness) -> None:
    bystander = harness.start()
    bomb = harness.start(max_processes=32)
    out = bomb.bash("b() { b | b & }; b; sleep 2; echo survived", timeout=8)
    assert out is not None  # the agent answered (timeout or not), the host is fine
    assert bystander.python("print(6 * 7)")["stdout"].strip() == "42"
    # The host still forks freely.
    assert os.system("true") == 0
    harness.kill(bomb)
    assert not Path(f"/proc/{bomb.handle.pid}").exists() or not alive(bomb.handle.pid)
    assert bystander.python("print('still here')")["stdout"].strip() == "still here"
    harness.kill(bystander)


def test_memory_hog_is_contained(harness: Harness) -> None:
    bystander = harness.start()
    hog = harness.start(memory_mb=192)
    # Several processes, each under its own address-space rlimit, together over the
    # sandbox's memory cgroup limit: only the cgroup can stop them.
    out = hog.bash(
        "for i in 1 2 3 4; do python3 -c 'import time; b = bytearray(120 * 1024 * 1024); "
        "[b.__setitem__(i, 1) for i in range(0, len(b), 4096)]; time.sleep(2)' & done; wait; echo done",
        timeout=20)
    assert out is not None
    assert bystander.python("print(6 * 7)")["stdout"].strip() == "42"
    events = _cgroup_events(harness, hog.sandbox_id)
    assert events.get("oom_kill", 0) >= 1, events
    harness.kill(hog)
    harness.kill(bystander)


def test_disk_filler_is_capped(harness: Harness) -> None:
    sandbox = harness.start(workspace_mb=8, memory_mb=256)
    out = sandbox.python(
        "import errno, json\n"
        "res = {}\n"
        "for path in ['/workspace/fill', '/tmp/fill']:\n"
        "    n = 0\n"
        "    try:\n"
        "        with open(path, 'wb') as f:\n"
        "            while n < 400 * 1024 * 1024:\n"
        "                f.write(b'x' * (1 << 20)); f.flush(); n += 1 << 20\n"
        "    except OSError as e:\n"
        "        res[path] = [n, errno.errorcode.get(e.errno)]\n"
        "    else:\n"
        "        res[path] = [n, None]\n"
        "print(json.dumps(res))", timeout=30)
    res = json.loads(out["stdout"])
    assert res["/workspace/fill"][1] in ("ENOSPC", "EFBIG") and res["/workspace/fill"][0] <= 8 * 1024 * 1024
    assert res["/tmp/fill"][1] in ("ENOSPC", "EFBIG") and res["/tmp/fill"][0] <= 64 * 1024 * 1024
    assert sandbox.python("print('ok')")["stdout"].strip() == "ok"
    harness.kill(sandbox)


def test_kill_takes_every_process_and_the_cgroups(harness: Harness) -> None:
    sandbox = harness.start()
    sandbox.bash("(setsid sleep 300 &) ; (sleep 301 &) ; echo ok")
    groups = _cgroup_dirs(harness, sandbox.sandbox_id)
    assert groups and all(g.exists() for g in groups)
    members = set()
    for g in groups:
        members |= {int(p) for p in (g / "cgroup.procs").read_text().split()}
    assert len(members) >= 3
    harness.kill(sandbox)
    assert not any(g.exists() for g in groups)
    assert not any(alive(pid) for pid in members)


def _cgroup_dirs(harness: Harness, sandbox_id: str) -> list[Path]:
    return [Path(base) / sandbox_id for base in harness.launcher.client.cgroup_bases]


def _cgroup_events(harness: Harness, sandbox_id: str) -> dict[str, int]:
    from sandpool.providers.local.isolation.cgroups import SandboxCgroup

    return SandboxCgroup(_cgroup_dirs(harness, sandbox_id)).memory_events()
