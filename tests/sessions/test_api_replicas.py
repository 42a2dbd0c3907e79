"""Several `sandpool api` processes on one Redis: no double lease, nothing lost to a crash."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sessions_harness import ApiProcess, publish
from testkit import scrubbed_env, wait_for

from sandpool.contract import tenancy


@pytest.fixture
def replicas(redis_url, redis_prefix):
    started: list[ApiProcess] = []

    def make(count: int, *extra: str) -> list[ApiProcess]:
        fresh = [ApiProcess(redis_url, redis_prefix, *extra) for _ in range(count)]
        started.extend(fresh)
        for proc in fresh:
            proc.wait_ready()
        return fresh

    yield make
    for proc in started:
        proc.stop()


def code(source: str) -> dict[str, object]:
    return {"tool": "code_execution", "input": {"code": source}}


def test_two_apis_never_lease_one_sandbox_twice(replicas, r, keys) -> None:
    a, b = replicas(2)
    published = {publish(r, keys) for _ in range(12)}
    urls = [a.url, b.url] * 20

    def create(url: str) -> httpx.Response:
        return httpx.post(url + "/sessions", timeout=15)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(create, urls))
    granted = [x.json()["session_id"] for x in answers if x.status_code == 201]
    assert len(granted) == 12 and len(set(granted)) == 12
    assert sorted({x.status_code for x in answers}) == [201, 503]
    sandboxes = [r.hget(keys.session(sid), "sandbox") for sid in granted]
    assert sorted(sandboxes) == sorted(published)  # every sandbox exactly once
    for sandbox in published:
        assert r.hget(keys.sandbox(sandbox), "state") == "leased"
    # Each replica sees the other's sessions: destroy through the other one.
    for sid, x in zip(granted, [b, a] * 6, strict=True):
        assert httpx.delete(f"{x.url}/sessions/{sid}", timeout=10).status_code == 204
    assert r.zcard(keys.deadlines) == 0
    assert r.scard(keys.doomed) == 12
    total = r.hgetall(keys.usage_total(tenancy.STANDALONE_WORKSPACE))
    assert total["sessions_created"] == "12" and total["capacity_refusals"] == "28"


def test_log_lines_carry_the_request_id(replicas, r, keys) -> None:
    (a,) = replicas(1)
    publish(r, keys)
    resp = httpx.post(a.url + "/sessions", headers={"X-Request-Id": "rid-log-check"}, timeout=10)
    assert resp.status_code == 201 and resp.headers["x-request-id"] == "rid-log-check"

    def logged() -> list[dict]:
        lines = [json.loads(line) for line in Path(a.log.name).read_text().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("msg") == "session created"]

    (line,) = wait_for(logged, timeout=10, what="the log line")
    assert line["request_id"] == "rid-log-check" and line["service"] == "api"
    assert line["session"] == resp.json()["session_id"]


def test_killing_an_api_mid_load_loses_no_session(replicas, agents, r, keys) -> None:
    a, b = replicas(2)
    live = agents.start(2)
    for agent in live:
        publish(r, keys, address=agent.address, secret=agent.secret)
    for _ in range(20):
        publish(r, keys)  # lease-only sandboxes for the load
    sids = []
    for _ in range(2):
        resp = httpx.post(a.url + "/sessions", timeout=10)
        assert resp.status_code == 201
        sids.append(resp.json()["session_id"])
    for i, sid in enumerate(sids):
        assert httpx.post(f"{a.url}/sessions/{sid}/exec", json=code(f"state = {i}"), timeout=30).status_code == 200

    def hammer(_: int) -> tuple[int, str | None]:
        try:
            resp = httpx.post(a.url + "/sessions", timeout=5)
        except httpx.HTTPError:
            return 0, None
        return resp.status_code, resp.json().get("session_id") if resp.status_code == 201 else None

    with ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(hammer, i) for i in range(40)]
        a.kill()  # SIGKILL while creates are in flight
        outcomes = [f.result() for f in pending]

    # Every create that was answered 201 is a live session in Redis; nothing half-made.
    confirmed = [sid for status, sid in outcomes if status == 201]
    for sid in confirmed:
        assert r.exists(keys.session(sid))
    session_ids = set(r.zrange(keys.deadlines, 0, -1))
    assert set(confirmed) | set(sids) <= session_ids
    for sid in session_ids:  # every indexed session is whole and owns its sandbox
        sandbox = r.hget(keys.session(sid), "sandbox")
        assert sandbox and r.hget(keys.sandbox(sandbox), "session") == sid
        assert r.hget(keys.sandbox(sandbox), "state") == "leased"
    leased = {r.hget(keys.session(sid), "sandbox") for sid in session_ids}
    ready = set(r.lrange(keys.pool_ready("default"), 0, -1))
    assert len(leased) + len(ready) == 22 and not leased & ready  # no sandbox lost or doubled

    # The survivor carries on with the sessions the dead replica created, state intact.
    for i, sid in enumerate(sids):
        resp = httpx.post(f"{b.url}/sessions/{sid}/exec", json=code("print(state)"), timeout=30)
        assert resp.status_code == 200 and resp.json()["result_block"]["content"]["stdout"] == f"{i}\n"
        assert httpx.delete(f"{b.url}/sessions/{sid}", timeout=10).status_code == 204


@pytest.mark.parametrize(("flags", "message"), [
    ([], "no mode"),
    (["--no-auth", "--auth-public-key", "{key}"], "exclude each other"),
    (["--max-sandboxes", "1", "--pool-size", "5", "--no-auth"], "pool_size"),
])
def test_the_command_refuses_an_unclear_mode(redis_url, tmp_path, flags, message) -> None:
    import subprocess
    import sys

    from sandpool.edge.keys_cli import generate_keypair

    _, public = generate_keypair(tmp_path / "key.pem")
    argv = [flag.format(key=public) for flag in flags]
    proc = subprocess.run([sys.executable, "-m", "sandpool", "api", "--port", "0", "--redis-url", redis_url, *argv],
                          env=scrubbed_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
