"""`--provider simulated`: the real controller and api, a real redis-server, sandboxes as records only.

One pass through the contract (create, execute, a file written and read back, destroy) against
`sandpool controller --provider simulated` and `sandpool api` as processes: what bench/scale.py
builds its 100,000 sessions on. The simulated agents' server answers with the per-sandbox secret
the controller published, as a real agent does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import redis
from testkit import free_port, scrubbed_env, stop_group, wait_for, wait_http

from sandpool.providers.simulated.provider import WARNING
from sandpool.providers.simulated.server import FIXED_STDOUT
from sandpool.state.keys import Keys


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, redis_prefix: str) -> Iterator[dict[str, str]]:
    shared = ["--redis-url", redis_url, "--redis-prefix", redis_prefix, "--pool-size", "2", "--max-sandboxes", "4"]
    commands = {"controller": ["controller", *shared, "--provider", "simulated"], "api": ["api", *shared, "--no-auth"]}
    urls: dict[str, str] = {}
    with ExitStack() as stack:
        procs = {}
        for name, command in commands.items():  # both start at once: the test's time is their imports
            port = free_port()
            log = stack.enter_context((tmp_path / f"{name}.log").open("wb"))
            procs[name] = subprocess.Popen([sys.executable, "-m", "sandpool", *command, "--port", str(port)],
                                           stdout=log, stderr=subprocess.STDOUT, env=scrubbed_env(),
                                           start_new_session=True)
            stack.callback(stop_group, procs[name], 10)
            urls[name] = f"http://127.0.0.1:{port}"
        for name, proc in procs.items():
            wait_http(urls[name] + "/readyz", proc=proc, log=tmp_path / f"{name}.log", timeout=20,
                      what=f"{name} ready")
        urls["controller_log"] = str(tmp_path / "controller.log")
        urls["controller_pid"] = str(procs["controller"].pid)
        yield urls


def test_a_session_runs_through_the_real_control_plane(stack: dict[str, str], redis_url: str,
                                                       redis_prefix: str) -> None:
    assert WARNING in Path(stack["controller_log"]).read_text()  # said loudly, at start
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = Keys(redis_prefix)
    ready = keys.pool_ready("default")
    with httpx.Client(base_url=stack["api"], timeout=10) as client:
        wait_for(lambda: r.llen(ready) == 2, timeout=10, what="two simulated sandboxes ready")
        created = client.post("/sessions", json={})
        assert created.status_code == 201, created.text
        session = created.json()["session_id"]

        done = client.post(f"/sessions/{session}/exec", json={"tool": "code_execution", "input": {"code": "1/0"}})
        assert done.status_code == 200, done.text
        assert done.json()["result_block"]["content"]["stdout"] == FIXED_STDOUT  # no code ran
        bad = client.post(f"/sessions/{session}/exec", json={"tool": "no_such_tool", "input": {}})
        assert bad.status_code == 400

        put = client.post(f"/sessions/{session}/files", files={"file": ("a.txt", b"hello")}, data={"path": "d/a.txt"})
        assert put.status_code == 201 and put.json() == {"path": "d/a.txt", "size_bytes": 5}
        assert client.get(f"/sessions/{session}/files", params={"path": "d/a.txt"}).content == b"hello"
        listed = client.get(f"/sessions/{session}/files/list", params={"path": "d"}).json()["files"]
        assert [(f["path"], f["size_bytes"]) for f in listed] == [("d/a.txt", 5)]
        assert client.get(f"/sessions/{session}/files", params={"path": "../etc/passwd"}).status_code == 403

        # The agent's side checks the secret the controller published, as a real agent does.
        address = r.hget(keys.session(session), "address")
        assert address and address.startswith("http://")
        assert httpx.get(f"{address}/healthz").status_code == 200
        assert httpx.post(f"{address}/sessions/{session}/exec", headers={"Authorization": "Bearer wrong"},
                          json={"tool": "code_execution", "input": {"code": "1"}}).status_code == 401
        sandbox = r.hget(keys.session(session), "sandbox")
        secret = r.hget(keys.sandbox(sandbox), "secret")
        direct = {"headers": {"Authorization": f"Bearer {secret}"},
                  "json": {"tool": "code_execution", "input": {"code": "1"}}}
        assert httpx.post(f"{address}/sessions/{session}/exec", **direct).status_code == 200

        assert client.delete(f"/sessions/{session}").status_code == 204
        assert client.post(f"/sessions/{session}/exec",
                           json={"tool": "code_execution", "input": {"code": "1"}}).status_code == 404
        members = keys.pool_members("default")
        # Its sandbox destroyed (the controller drained it), the pool back at its warm floor.
        wait_for(lambda: r.scard(members) == 2 and r.llen(ready) == 2, timeout=10, what="pool back at 2")
        # The agents' process forgot the destroyed sandbox: its secret opens nothing any more.
        assert httpx.post(f"{address}/sessions/{session}/exec", **direct).status_code == 401


def test_the_agents_process_ends_with_the_controller(stack: dict[str, str]) -> None:
    controller = int(stack["controller_pid"])
    children = Path(f"/proc/{controller}/task/{controller}/children").read_text().split()
    agents = [int(pid) for pid in children if b"simulated.process" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(agents) == 1, children
    os.kill(controller, signal.SIGKILL)  # no clean-up of its own: the agents' stdin closing is the cue
    wait_for(lambda: not Path(f"/proc/{agents[0]}").exists() or
             Path(f"/proc/{agents[0]}/stat").read_text().split(")")[1].split()[0] == "Z",
             timeout=10, what="the simulated agents' process ended")


def test_when_the_agents_process_dies_its_sandboxes_are_lost(stack: dict[str, str], redis_url: str,
                                                            redis_prefix: str) -> None:
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    ready = Keys(redis_prefix).pool_ready("default")
    wait_for(lambda: r.llen(ready) == 2, timeout=10, what="two simulated sandboxes ready")
    controller = int(stack["controller_pid"])
    children = Path(f"/proc/{controller}/task/{controller}/children").read_text().split()
    agents = [int(pid) for pid in children if b"simulated.process" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    os.kill(agents[0], signal.SIGKILL)
    # Told as lost, as when a zygote dies: nothing is left leasable, and nothing new is (creates fail).
    wait_for(lambda: r.llen(ready) == 0, timeout=10, what="the lost sandboxes out of the ready list")
    assert "every simulated sandbox is lost" in Path(stack["controller_log"]).read_text()
