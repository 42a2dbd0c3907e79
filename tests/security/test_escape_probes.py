"""Escape probes from inside a sandbox of the deployed stack (proxy -> scheduler -> local provider).

tests/isolation probes the launcher's layers one by one with its own harness;
these run hostile code in a session leased through the proxy, aimed at the
concrete pieces of a running installation: the scheduler's and the proxy's
ports, this stack's Redis and its data, the internal credential and the
signing key on disk, another live session's agent socket, files and processes,
shared temp dirs, and the network. Each target is first shown reachable from
the host (so every probe can fail).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from sp_harness import INTERNAL_TOKEN, Stack

from sandpool.state.keys import Keys

pytestmark = pytest.mark.isolation  # needs root: namespaces, per-sandbox uids

PROBE = r'''
import json, os, socket
T = json.loads(TARGETS)
res = {}
def tcp(port):
    s = socket.socket(); s.settimeout(1)
    try:
        s.connect(("127.0.0.1", port)); return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
def unix(path):
    s = socket.socket(socket.AF_UNIX); s.settimeout(1)
    try:
        s.connect(path); return "connected"
    except OSError as e:
        return type(e).__name__
    finally:
        s.close()
def read(path):
    try:
        with open(path, "rb") as fh:
            return "READ:" + fh.read(4096).decode("latin-1")
    except OSError as e:
        return type(e).__name__
def listing(path):
    try:
        return "LISTED:" + ",".join(sorted(os.listdir(path)))
    except OSError as e:
        return type(e).__name__
for name, port in T["ports"].items():
    res["tcp:" + name] = tcp(port)
res["unix:other_agent"] = unix(T["other_socket"])
for name, path in T["files"].items():
    res["read:" + name] = read(path)
for name, path in T["dirs"].items():
    res["list:" + name] = listing(path)
try:
    os.kill(T["scheduler_pid"], 0); res["signal:scheduler"] = "signalled"
except OSError as e:
    res["signal:scheduler"] = type(e).__name__
res["environ:1"] = read("/proc/1/environ")
res["ifaces"] = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else []
res["uid"] = os.getuid()
for d in ("/tmp", "/dev/shm"):
    try:
        open(os.path.join(d, "escape-marker"), "w").write("a")
    except OSError:
        pass
print(json.dumps(res))
'''


def sandbox_of(stack: Stack, sid: str) -> Path:
    with stack.rdb() as r:
        return stack.root / "sandboxes" / str(r.hget(Keys(stack.prefix).session(sid), "sandbox"))


def run(client: Any, sid: str, code: str) -> dict[str, Any]:
    response = client.post(f"/sessions/{sid}/exec", json={"tool": "code_execution", "input": {"code": code},
                                                          "timeout_seconds": 30})
    assert response.status_code == 200, response.text
    return response.json()["result_block"]["content"]


def test_a_sandbox_reaches_nothing_of_the_installation(stack: Stack) -> None:
    attacker, victim = stack.client("attacker"), stack.client("victim")
    try:
        a_sid = attacker.post("/sessions", json={}).json()["session_id"]
        v_sid = victim.post("/sessions", json={}).json()["session_id"]
        run(victim, v_sid, "open('secret.txt', 'w').write('victim-secret')")
        victim_dir = sandbox_of(stack, v_sid)
        scheduler, proxy = stack.schedulers[0], stack.proxy
        assert proxy is not None and stack.private_key is not None
        targets = {
            "ports": {"scheduler": scheduler.port, "proxy": proxy.port, "redis": stack.redis.port},
            "other_socket": json.loads((victim_dir / "meta.json").read_text())["socket"],
            "files": {"other_secret": str(victim_dir / "secret"), "other_meta": str(victim_dir / "meta.json"),
                      "other_workspace_file": str(victim_dir / "workspace" / "secret.txt"),
                      "internal_token": str(stack.token_file), "signing_key": str(stack.private_key),
                      "redis_log": str(stack.redis.log), "scheduler_log": str(scheduler.log),
                      "host_shadow": "/etc/shadow", "scheduler_environ": f"/proc/{scheduler.pid}/environ"},
            "dirs": {"data_dir": str(stack.root), "sandboxes": str(stack.root / "sandboxes"),
                     "redis_dir": str(stack.redis.dir), "other_workspace": str(victim_dir / "workspace")},
            "scheduler_pid": scheduler.pid,
        }
        # Every target is there and reachable from the host: the probes below can fail.
        for port in targets["ports"].values():
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
        assert os.path.exists(targets["other_socket"]) and stack.token_file.read_text() == INTERNAL_TOKEN
        out = run(attacker, a_sid, f"TARGETS = {json.dumps(json.dumps(targets))}\n" + PROBE)
        res = json.loads(out["stdout"])
        assert all(v != "connected" for k, v in res.items() if k.startswith(("tcp:", "unix:"))), res
        leaked = {k: v for k, v in res.items() if k.startswith("read:") and v.startswith("READ:") and v != "READ:"}
        assert leaked == {}, leaked
        assert not any(v.startswith("LISTED:") and v != "LISTED:" for k, v in res.items() if k.startswith("list:")), res
        assert res["signal:scheduler"] != "signalled", res
        for secret in (INTERNAL_TOKEN, "SANDPOOL_", stack.redis.url, str(stack.root)):
            assert secret not in res["environ:1"], res["environ:1"]
        assert res["ifaces"] in ([], ["lo"]), res["ifaces"]
        assert res["uid"] != 0
        # Shared temp dirs are not shared: the victim sees none of the attacker's markers.
        seen = run(victim, v_sid, "import os\nprint([p for p in ('/tmp/escape-marker', '/dev/shm/escape-marker') "
                                  "if os.path.exists(p)])")
        assert seen["stdout"].strip() == "[]", seen
        # The victim's file is intact and only its own session reads it.
        assert victim.get(f"/sessions/{v_sid}/files", params={"path": "secret.txt"}).content == b"victim-secret"
        attacker.delete(f"/sessions/{a_sid}")
        victim.delete(f"/sessions/{v_sid}")
    finally:
        attacker.close()
        victim.close()


def test_sandboxed_code_cannot_outlive_its_session(stack: Stack) -> None:
    """A double-forked, setsid'd process left behind is gone once the session is destroyed."""
    client = stack.client("attacker")
    try:
        sid = client.post("/sessions", json={}).json()["session_id"]
        directory = sandbox_of(stack, sid)
        out = run(client, sid, "import os, subprocess\n"
                               "subprocess.Popen(['sh', '-c', 'setsid sleep 1000 & echo started'], "
                               "start_new_session=True).wait()\nprint(os.getuid())")
        uid = int(out["stdout"].split()[-1])
        assert client.delete(f"/sessions/{sid}").status_code == 204

        def uid_processes() -> list[int]:
            found = []
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        if entry.stat().st_uid == uid and "sleep" in (entry / "cmdline").read_text():
                            found.append(int(entry.name))
                    except OSError:
                        continue
            return found

        from testkit import wait_for

        wait_for(lambda: not uid_processes(), timeout=30, what="the session's processes to be gone")
        wait_for(lambda: not directory.exists(), timeout=30, what="the sandbox directory to be removed")
    finally:
        client.close()
