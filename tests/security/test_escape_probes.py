"""Escape probes from inside a sandbox of the deployed stack (api; controller -> local provider).

tests/isolation probes the launcher's layers one by one with its own harness;
these run hostile code in a session leased through the api, aimed at the
concrete pieces of a running installation: the api's and the controller's
ports and processes, this stack's Redis and its data, the signing key and the
services' logs on disk, another live session's agent socket, files and
processes, shared temp dirs, and the network. Each target is first shown
reachable from the host (so every probe can fail).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
from sp_harness import Stack

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
for name, pid in T["pids"].items():
    try:
        os.kill(pid, 0); res["signal:" + name] = "signalled"
    except OSError as e:
        res["signal:" + name] = type(e).__name__
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
        controller, api = stack.controllers[0], stack.api
        assert stack.private_key is not None
        targets = {
            "ports": {"controller": controller.port, "api": api.port, "redis": stack.redis.port},
            "other_socket": json.loads((victim_dir / "meta.json").read_text())["socket"],
            "files": {"other_secret": str(victim_dir / "secret"), "other_meta": str(victim_dir / "meta.json"),
                      "other_workspace_file": str(victim_dir / "workspace" / "secret.txt"),
                      "signing_key": str(stack.private_key), "redis_log": str(stack.redis.log),
                      "controller_log": str(controller.log), "api_log": str(api.log), "host_shadow": "/etc/shadow",
                      "controller_environ": f"/proc/{controller.pid}/environ",
                      "api_environ": f"/proc/{api.pid}/environ"},
            "dirs": {"data_dir": str(stack.root), "sandboxes": str(stack.root / "sandboxes"),
                     "redis_dir": str(stack.redis.dir), "other_workspace": str(victim_dir / "workspace")},
            "pids": {"controller": controller.pid, "api": api.pid},
        }
        # Every target is there and reachable from the host: the probes below can fail.
        for port in targets["ports"].values():
            with socket.create_connection(("127.0.0.1", port), timeout=2):
                pass
        assert os.path.exists(targets["other_socket"]) and stack.private_key.exists()
        out = run(attacker, a_sid, f"TARGETS = {json.dumps(json.dumps(targets))}\n" + PROBE)
        res = json.loads(out["stdout"])
        assert all(v != "connected" for k, v in res.items() if k.startswith(("tcp:", "unix:"))), res
        leaked = {k: v for k, v in res.items() if k.startswith("read:") and v.startswith("READ:") and v != "READ:"}
        assert leaked == {}, leaked
        assert not any(v.startswith("LISTED:") and v != "LISTED:" for k, v in res.items() if k.startswith("list:")), res
        assert res["signal:controller"] != "signalled" and res["signal:api"] != "signalled", res
        for secret in ("SANDPOOL_", stack.redis.url, str(stack.root)):
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
