"""The api's request path as a client sees it: tenancy from the token only (inbound `X-Sandpool-*` headers are
ignored), body caps, Redis down fails closed, health and metrics, request ids, log lines, a client that leaves."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import time
from collections.abc import Callable

import pytest
import redis
from sse_events import STREAM_HEADERS, collect, result_of, text_of
from testkit import free_port, wait_for

from sandpool.contract import tenancy
from sandpool.core.logs import JsonFormatter
from sandpool.state.keys import Keys as RedisKeys

from .conftest import Api, Keys
from .stack import PRINT_1, Sandboxes, Stack

FORGED = {
    "X-Sandpool-Workspace": "victim",
    "x-sandpool-max-concurrent-sessions": "100000",
    "X-SANDPOOL-DAILY-SESSION-SECONDS-BUDGET": "0",
    "X-Sandpool-Max-Lifetime-Seconds": "999999",
    "X-Sandpool-Egress-Allow": "*",
    "X-Sandpool-Anything-New": "1",
}


def test_inbound_sandpool_headers_change_neither_the_workspace_nor_its_limits(
        api: Api, keys: Keys, rdb: redis.Redis, redis_prefix: str, sandboxes: Sandboxes) -> None:
    rkeys = RedisKeys(redis_prefix)
    for _ in range(3):
        sandboxes.publish()
    with api.client(keys.token("ops", admin=True)) as admin:
        assert admin.put("/v1/workspaces/acme/policy", json={"max_concurrent_sessions": 1, "max_lifetime_seconds": 600,
                                                             "daily_session_seconds_budget": 600}).status_code == 200
    with api.client(keys.token("acme")) as client:
        created = client.post("/sessions", json={}, headers={**FORGED, "X-Request-Id": "req-42"})
        assert created.status_code == 201, created.text
        assert created.headers["x-request-id"] == "req-42"
        assert created.json()["max_lifetime_seconds"] == 600  # the policy's, not the forged header's
        second = client.post("/sessions", json={}, headers=FORGED)
    sid = created.json()["session_id"]
    assert second.status_code == 429 and second.json()["limit"] == "max_concurrent_sessions"  # not 100000
    record = rdb.hgetall(rkeys.session(sid))
    assert record["workspace"] == "acme"
    in_force = json.loads(record["limits"])
    assert in_force["max_concurrent_sessions"] == 1 and in_force["daily_session_seconds_budget"] == 600
    assert rdb.smembers(rkeys.workspace_sessions("acme")) == {sid}
    assert rdb.exists(rkeys.workspace_sessions("victim"), rkeys.usage_total("victim")) == 0
    assert sandboxes.ready() == 2


def test_standalone_api_serves_one_workspace_whatever_the_headers_say(
        make_api: Callable[..., Api], rdb: redis.Redis, redis_prefix: str, sandboxes: Sandboxes) -> None:
    api = make_api(auth=False, auth_public_keys=[])
    sandboxes.publish()
    with api.client() as client:
        created = client.post("/sessions", json={}, headers=FORGED)
        admin_api = client.get("/v1/usage")
    assert created.status_code == 201, created.text
    record = rdb.hgetall(RedisKeys(redis_prefix).session(created.json()["session_id"]))
    assert record["workspace"] == tenancy.STANDALONE_WORKSPACE
    assert admin_api.status_code == 404  # no admin API without tenancy


def test_bodies_over_the_caps_are_413_and_nothing_is_leased_or_stored(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory(max_body_bytes=64 * 1024)
    stack.sandboxes.publish_agents(1)
    stack.sandboxes.publish()
    with stack.client("acme") as client:
        create = client.post("/sessions", content=b"{" + b" " * (70 * 1024) + b"}")
        assert create.status_code == 413, create.text
        assert stack.ready() == 2  # refused before any lease
        sid = client.post("/sessions", json={}).json()["session_id"]
        declared = client.post(f"/sessions/{sid}/files", files={"file": ("big.bin", b"x" * (64 * 1024 + 1))},
                               data={"path": "big.bin"})
        head = client.build_request("POST", f"/sessions/{sid}/files", data={"path": "streamed.bin"},
                                    files={"file": ("streamed.bin", b"y" * (128 * 1024))})
        body = head.read()
        streamed = client.post(f"/sessions/{sid}/files", headers={"Content-Type": head.headers["content-type"]},
                               content=iter([body[i:i + 32768] for i in range(0, len(body), 32768)]))
        for response in (create, declared, streamed):
            assert response.status_code == 413, response.text
            assert response.json()["reason"] == "payload_too_large"
        small = os.urandom(1000)
        assert client.post(f"/sessions/{sid}/files", files={"file": ("a b.bin", small)},
                           data={"path": "a b.bin"}).status_code == 201
        listed = client.get(f"/sessions/{sid}/files/list").json()["files"]
        assert [f["path"] for f in listed] == ["a b.bin"]  # neither refused upload left a file
        assert client.get(f"/sessions/{sid}/files", params={"path": "a b.bin"}).content == small


def test_redis_down_fails_closed(make_api: Callable[..., Api], keys: Keys) -> None:
    api = make_api(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_seconds=0.5)
    with api.client(keys.token()) as client:
        response = client.post("/sessions", json={})
        ready = client.get("/readyz")
        metrics = client.get("/metrics").text
    assert response.status_code == 503 and response.json()["reason"] == "redis_unavailable"
    assert "retry-after" in response.headers
    assert ready.status_code == 503
    assert ready.json() == {"status": "not ready", "checks": {"redis": "unreachable"}}
    assert 'sandpool_redis_errors_total{service="api"}' in metrics


def test_health_readiness_and_metrics(api: Api, keys: Keys, sandboxes: Sandboxes) -> None:
    sandboxes.publish()
    with api.client(keys.token()) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert client.get("/readyz").json() == {"status": "ready", "checks": {"redis": "ok"}}
        assert client.post("/sessions", json={}).status_code == 201
        assert client.get("/nope").status_code == 404
        metrics = client.get("/metrics").text
    assert 'sandpool_requests_total{operation="CreateSession",service="api",status="201"} 1.0' in metrics
    assert 'sandpool_requests_total{operation="other",service="api",status="404"} 1.0' in metrics
    assert 'sandpool_request_duration_seconds_count{operation="CreateSession",service="api"} 1.0' in metrics
    assert 'sandpool_leases_total{outcome="granted"} 1.0' in metrics


def test_request_id_generated_when_absent_or_unsafe(api: Api, keys: Keys) -> None:
    with api.client(keys.token()) as client:
        generated = client.get("/v1/usage")
        unsafe = client.get("/v1/usage", headers={"X-Request-Id": "a b\tc" + "x" * 200})
        refused = client.post("/sessions", json={})  # no sandbox: a 503 carries one too
    assert refused.status_code == 503
    rids = [response.headers["x-request-id"] for response in (generated, unsafe, refused)]
    assert all(len(rid) == 32 for rid in rids) and len(set(rids)) == 3


def test_log_lines_carry_the_request_id_and_never_the_token(api: Api, keys: Keys) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("api"))
    logger = logging.getLogger("sandpool")  # the api's own lines and the access lines
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    token = keys.token(now=0, ttl_seconds=60)  # long expired
    try:
        with api.client() as client:
            client.post("/sessions", json={}, headers={"Authorization": f"Bearer {token}", "X-Request-Id": "rid-7"})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    refused = [line for line in lines if line["msg"] == "credential refused"]
    assert refused and refused[0]["request_id"] == "rid-7" and refused[0]["reason"] == "expired"
    access = [line for line in lines if line["msg"] == "request"]
    assert access and access[0]["status"] == 401 and access[0]["operation"] == "CreateSession"
    assert access[0]["request_id"] == "rid-7" and access[0]["path"] == "/sessions"
    assert token.split(".")[1] not in stream.getvalue() and token.split(".")[2] not in stream.getvalue()


def test_an_execute_access_line_names_its_tool_and_outcome(stack: Stack) -> None:
    """What the agent's own line added (agents log at warning by default): the api's line says it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("api"))
    logger = logging.getLogger("sandpool.access")
    logger.addHandler(handler)
    previous = logger.level
    logger.setLevel(logging.INFO)
    stack.sandboxes.publish_agents(1)
    try:
        with stack.client("acme") as client:
            sid = client.post("/sessions", json={}).json()["session_id"]
            ok = client.post(f"/sessions/{sid}/exec", json=PRINT_1, headers={"X-Request-Id": "rid-ok"})
            failed = client.post(f"/sessions/{sid}/exec", headers={"X-Request-Id": "rid-failed"},
                                 json={"tool": "bash_code_execution", "input": {"command": "exit 3"}})
            unknown = client.post("/sessions/no-such-session/exec", json=PRINT_1, headers={"X-Request-Id": "rid-404"})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
    assert ok.status_code == 200 and failed.status_code == 200 and unknown.status_code == 404
    lines = {line.get("request_id"): line for line in map(json.loads, stream.getvalue().splitlines())}
    assert lines["rid-ok"]["tool"] == "code_execution" and lines["rid-ok"]["outcome"] == "ok"
    assert lines["rid-failed"]["tool"] == "bash_code_execution" and lines["rid-failed"]["outcome"] == "failed"
    assert lines["rid-404"]["status"] == 404 and "outcome" not in lines["rid-404"]


def test_a_client_leaving_mid_upload_is_dropped_quietly(stack: Stack, caplog: pytest.LogCaptureFixture) -> None:
    stack.sandboxes.publish_agents(1)
    with stack.client("acme") as client:
        sid = client.post("/sessions", json={}).json()["session_id"]
    boundary = "b0undary"
    head = (f"POST /sessions/{sid}/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {stack.keys.token()}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: 100000\r\n\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"half.bin\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", stack.api.port)) as raw:
        raw.sendall(head + b"x" * 1000)
        time.sleep(0.2)  # let the api start the forward before the client vanishes
    with stack.client("acme") as client:
        wait_for(lambda: client.get("/healthz").status_code == 200, timeout=10, what="the api healthy")
        assert client.post(f"/sessions/{sid}/exec", json=PRINT_1).json()["result_block"]["content"]["stdout"] == "1\n"
        assert client.get(f"/sessions/{sid}/files/list").json()["files"] == []  # the half upload was not kept
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(("uvicorn", "sandpool"))]


def test_a_streamed_execute_and_cancel_through_the_edge(stack: Stack) -> None:
    """A streamed Execute (docs/api.md) and CancelExecution pass the edge like any session call, the
    workspace checked on each."""
    stack.sandboxes.publish_agents(1)
    with stack.client("acme") as acme, stack.client("globex") as globex:
        sid = acme.post("/sessions", json={}).json()["session_id"]
        with acme.stream("POST", f"/sessions/{sid}/exec", headers=STREAM_HEADERS,
                         json={"tool": "code_execution", "input": {"code": "print('streamed')"}}) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            events = collect(response.iter_lines())
        assert text_of(events, "stdout") == "streamed\n"
        assert result_of(events)["result_block"]["content"]["stdout"] == "streamed\n"
        idle = acme.delete(f"/sessions/{sid}/exec")
        assert idle.status_code == 409 and idle.json()["reason"] == "no_running_call"
        foreign = globex.delete(f"/sessions/{sid}/exec", headers={"X-Sandpool-Workspace": "acme"})
        assert foreign.status_code == 404
        with globex.stream("POST", f"/sessions/{sid}/exec", headers={**STREAM_HEADERS,
                                                                     "X-Sandpool-Workspace": "acme"},
                           json=PRINT_1) as response:
            assert response.status_code == 404
